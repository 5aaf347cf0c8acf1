"""Dispatch benchmark: dispatch+combine time and bytes sent per token, our all-to-all dispatcher
(single-stage, and node-aware over simulated nodes of ``--node-size`` ranks where ep spans
several) against transformers' own all-to-all expert parallelism (``AllToAllEP``) on the identical
routing, for Mixtral (E=8, k=2) and a fine-grained model (E=64, k=6) at ep = 2, 4, 8. The
network column counts what crosses between those nodes: the node-aware dispatch's point.

Bytes come from ``moe_ep.dispatch.wire_bytes`` (computed from each rank's routing, both schemes)
plus each scheme's per-layer count exchange; they are also counted on the wire by wrapping each
implementation's collectives, which checks the accounting. Times come from
``ep`` spawned processes: NCCL when there are ``ep`` GPUs; with fewer, the ranks share the first
GPU over gloo, whose times include its staging through the host, and each rank's own GPU kernels
(the packing, forwarding, weighting and sums around the exchanges: what the dispatcher costs a
GPU) are timed apart with the profiler as 'local GPU ms'; without a GPU, gloo on the CPU (there
the times are only indicative: all ranks share the host's cores, so each rank gets ``threads //
ep`` torch threads, at least one, instead of every rank starting the host's full count and the
ranks' OpenMP barriers waiting on each other's descheduled threads). The experts are an identity that
applies the weights they are handed (ours: a multi row's routing weights) so only the exchange
is timed; ours get the received rows as ``moe_experts_ep`` hands them to moe_ep's experts, with
one column per local expert a row can carry, and scale each row once by its columns' weights.
Each rank times its own calls and the slowest rank's median is reported."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .arguments import int_at_least
from ..dispatch import count_exchange_bytes, node_count_exchange_bytes, node_wire_bytes, split_by_node, wire_bytes
from ..dispatch.dispatcher import combine_checked, dispatch_checked
from .optional import Lookup, optional_attr
from .report import Column, Report, close_figure, environment, new_figure
from .routing_cases import ROUTINGS, make_routing
from .timing import measure

HF_EP_MODULE = "transformers.distributed.expert_parallel"
MODELS = {"mixtral": (8, 2), "fine-grained": (64, 6)}  # name -> (E, k)
SHARED_GPU = "gloo, one GPU"  # the backend of ranks sharing one GPU (see pick_backend)
DEFAULTS = {"cpu": dict(tokens=1024, hidden=1024, dtype="float32"),
            "cuda": dict(tokens=4096, hidden=4096, dtype="bfloat16")}

COLUMNS = [
    Column("model", "model"),
    Column("ep", "ep"),
    Column("routing", "routing"),
    Column("impl", "impl"),
    Column("rows_per_token", "rows/token", "{:.3f}"),
    Column("bytes_per_token", "bytes/token", "{:,.0f}"),
    Column("measured_bytes_per_token", "measured", "{:,.0f}"),
    Column("bytes_vs_hf", "bytes vs hf", "{:.3f}"),
    Column("network_bytes_per_token", "network/token", "{:,.0f}"),
    Column("ms_fwd", "ms fwd", "{:.2f}"),
    Column("ms_fwd_bwd", "ms fwd+bwd", "{:.2f}"),
    Column("local_gpu_ms", "local GPU ms", "{:.3f}"),
    Column("max_abs_err", "err", "{:.0e}"),
    Column("backend", "backend"),
    Column("status", "status"),
]


@dataclass(frozen=True)
class Settings:
    tokens: int  # per rank
    hidden: int
    dtype: str
    models: tuple
    routings: tuple
    seed: int
    warmup: int
    reps: int
    node_size: int  # ranks per simulated node of the node-aware rows

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def rank_routing(s: Settings, model: str, routing: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    E, K = MODELS[model]
    return make_routing(routing, s.tokens, E, K, seed=s.seed * 1000 + rank)


@dataclass(frozen=True)
class Traffic:
    rows: int  # token rows sent to other ranks, dispatch + combine
    bytes: int  # rows, their routing columns and the count exchange
    network_bytes: int  # the part between simulated nodes (count exchanges apart)


def spans_nodes(ep: int, node_size: int) -> bool:
    """Whether an ep group of ``ep`` ranks covers several whole simulated nodes."""
    return ep > node_size and ep % node_size == 0


def _network_bytes(idx_TK: torch.Tensor, L: int, rank: int, node_size: int, row_bytes: int,
                   rows_per_destination) -> int:
    """A single-stage scheme's forward bytes (rows both ways, no routing columns) to ranks on other
    nodes; ``rows_per_destination``: the rows a token sends to a rank holding n of its experts."""
    dest_TK = idx_TK.long().cpu() // L
    other_node = dest_TK // node_size != rank // node_size
    experts_TR = torch.zeros(idx_TK.shape[0], int(dest_TK.max()) + 1 if dest_TK.numel() else 1, dtype=torch.long)
    experts_TR.scatter_add_(1, torch.where(other_node, dest_TK, 0), other_node.long())
    return 2 * row_bytes * int(rows_per_destination(experts_TR).sum())


def computed_bytes(s: Settings, model: str, routing: str, ep: int) -> dict[str, Traffic]:
    """Each scheme's forward traffic, summed over all ranks (the node-aware one only where ep
    spans several simulated nodes)."""
    E, K = MODELS[model]
    L, G, row_bytes = E // ep, s.node_size, s.hidden * s.element_size
    totals = {"hf_all_to_all": Traffic(0, 0, 0), "moe_ep": Traffic(0, 0, 0)}
    exchanged = count_exchange_bytes(E, ep, K)
    counts = {"hf_all_to_all": exchanged.transformers_bytes, "moe_ep": exchanged.moe_ep_bytes}
    idx_by_rank = [rank_routing(s, model, routing, rank)[0] for rank in range(ep)]
    for rank, idx_TK in enumerate(idx_by_rank):
        counted = wire_bytes(idx_TK, L, s.hidden, element_size=s.element_size, source_rank=rank)
        per_impl = {
            "hf_all_to_all": (2 * counted.transformers_rows, counted.transformers_bytes,
                              _network_bytes(idx_TK, L, rank, G, row_bytes, lambda n: n)),
            "moe_ep": (2 * counted.moe_ep_rows, counted.moe_ep_bytes,
                       _network_bytes(idx_TK, L, rank, G, row_bytes, lambda n: n > 0)),
        }
        for impl, (rows, bytes_, network) in per_impl.items():
            t = totals[impl]
            totals[impl] = Traffic(t.rows + rows, t.bytes + bytes_ + counts[impl], t.network_bytes + network)
    if spans_nodes(ep, G):
        inter_counts, intra_counts = node_count_exchange_bytes(E, ep, K, G)
        counted = node_wire_bytes(idx_by_rank, L, s.hidden, G, element_size=s.element_size)
        totals["moe_ep_node"] = Traffic(
            rows=sum(c.inter_rows + c.intra_rows for c in counted),
            bytes=sum(c.inter_bytes + c.intra_bytes for c in counted) + ep * (inter_counts + intra_counts),
            network_bytes=sum(c.inter_rows for c in counted) * row_bytes,
        )
    return totals


# ---------------------------------------------------------------- inside the spawned ranks


class IdentityExperts(torch.nn.Module):
    """Stands in for a rank's experts so that only the exchange is timed."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


# How the collectives transformers' all-to-all calls take the tensor they send, by positional name.
SEND_SIGNATURES = {
    "all_to_all_single": ("output", "input", "output_split_sizes", "input_split_sizes", "group"),
    "all_to_all_single_autograd": ("input", "output_split_sizes", "input_split_sizes", "group"),
}


@contextlib.contextmanager
def count_sent_bytes(module):
    """Wrap the collectives ``module`` calls (those of SEND_SIGNATURES it has) so that the bytes
    each call sends to other ranks of its group are added up in the yielded one-element list."""
    sent = [0]
    originals = {name: getattr(module, name) for name in SEND_SIGNATURES if hasattr(module, name)}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            bound = dict(zip(SEND_SIGNATURES[name], args), **kwargs)
            tensor, splits, group = bound["input"], bound.get("input_split_sizes"), bound.get("group")
            world, me = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
            splits = splits or [tensor.shape[0] // world] * world
            row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
            sent[0] += sum(n for r, n in enumerate(splits) if r != me) * row
            return original(*args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(module, name, counting(name, original))
    try:
        yield sent
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


@dataclass(frozen=True)
class Exchange:
    fn: object  # (x_TH, idx_TK, w_TK) -> y_TH = sum_k w_TK[:, k] * x_TH (identity experts)
    collectives: object  # the module whose collectives it calls by attribute, for count_sent_bytes


def _hf_exchange(ep_mesh, tp_mesh, nodes, num_experts: int) -> Lookup:
    cls = optional_attr(HF_EP_MODULE, "AllToAllEP")
    if not cls.available:
        return cls
    impl = cls.value(IdentityExperts(num_experts // ep_mesh.size()), ep_mesh, tp_mesh)
    return Lookup(Exchange(impl, importlib.import_module(HF_EP_MODULE)), None)


def _moe_ep_exchange(ep_mesh, tp_mesh, nodes, num_experts: int) -> Lookup:
    group = ep_mesh.get_group()

    experts_per_rank = num_experts // ep_mesh.size()

    def exchange(x_TH, idx_TK, w_TK):
        # The layer's own path (moe_experts_ep): the received rows with their columns, the experts
        # summing each row's pairs. Identity experts: a row's output is its columns' weights' sum
        # times the row.
        tokens = dispatch_checked(x_TH, idx_TK, w_TK, group, num_experts, None, nodes, rows=True)
        scale_S1 = (tokens.weights * (tokens.expert_ids < experts_per_rank)).sum(1, keepdim=True)
        return combine_checked(tokens.hidden_states * scale_S1.to(x_TH.dtype), tokens.layout)

    return Lookup(Exchange(exchange, torch.distributed), None)


def _moe_ep_node_exchange(ep_mesh, tp_mesh, nodes, num_experts: int) -> Lookup:
    if nodes is None:
        return Lookup(None, "ep within one simulated node")
    return _moe_ep_exchange(ep_mesh, tp_mesh, nodes, num_experts)


# name -> (builder, whether it takes the node groups)
EXCHANGES = {"hf_all_to_all": (_hf_exchange, False), "moe_ep": (_moe_ep_exchange, False),
             "moe_ep_node": (_moe_ep_node_exchange, True)}


def _time_rank(s: Settings, impl, x_TH, idx_TK, w_TK, device) -> tuple[float, float]:
    import torch.distributed as dist

    dy_TH = torch.ones_like(x_TH)

    def fwd():
        return impl(x_TH, idx_TK, w_TK)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), (x_TH, w_TK), dy_TH)

    times = []
    for fn in (fwd, fwd_bwd):
        dist.barrier()
        # No extra rounds: every rank must issue the same collectives (see measure_many).
        times.append(measure(fn, device=device, warmup=s.warmup, reps=s.reps, name=fn.__name__, extra_rounds=0).median_s)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return tuple(slowest.tolist())


LOCAL_KERNELS_LISTED = 5  # the longest kernels named beside the local GPU time (rank 0's)


def _local_gpu_ms(impl, x_TH, idx_TK, w_TK) -> tuple[float, list[tuple[str, int, float]]]:
    """The slowest rank's GPU time of its own kernels in one forward and backward (the packing,
    forwarding, weighting and sums around the exchanges), gloo's copies to and from the host left
    out: what the dispatcher itself costs a GPU, whatever the network; and this rank's longest
    kernels, as (name, launches, ms), to say where that time goes."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    def fwd_bwd():
        return torch.autograd.grad(impl(x_TH, idx_TK, w_TK), (x_TH, w_TK), torch.ones_like(x_TH))

    fwd_bwd()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd_bwd()
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.count, e.self_device_time_total / 1e3) for e in prof.key_averages()
                      if e.self_device_time_total > 0 and not e.key.startswith(("Memcpy", "Memset"))),
                     key=lambda k: -k[2])
    slowest = torch.tensor([sum(ms for *_, ms in kernels)], dtype=torch.float64, device=x_TH.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item(), kernels[:LOCAL_KERNELS_LISTED]


def threads_per_rank(ep: int) -> int:
    """The host's torch threads (``--threads``, else torch's default) shared by the ``ep`` ranks."""
    return max(1, torch.get_num_threads() // ep)


def _worker(rank: int, ep: int, port: int, backend: str, threads: int, settings: dict, out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    s = Settings(**settings)
    shared = backend == SHARED_GPU
    device = torch.device("cuda", 0 if shared else rank) if backend != "gloo" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if shared else backend, rank=rank, world_size=ep)
    try:
        # transformers' scheme takes a tensor-parallel mesh too; size 1 here: every rank has its own batch.
        mesh = init_device_mesh("cpu" if shared else device.type, (1, ep), mesh_dim_names=("tp", "ep"))
        nodes = split_by_node([list(range(ep))], s.node_size) if spans_nodes(ep, s.node_size) else None
        results = []
        for model in s.models:
            E, _ = MODELS[model]
            for routing in s.routings:
                idx_TK, w_TK = rank_routing(s, model, routing, rank)
                g = torch.Generator().manual_seed(s.seed + rank)
                x_TH = torch.randn(s.tokens, s.hidden, generator=g).to(device, getattr(torch, s.dtype))
                x_TH.requires_grad_()
                w_TK = w_TK.to(device).requires_grad_()
                idx_TK = idx_TK.to(device)
                reference = x_TH.detach() * w_TK.detach().sum(1, keepdim=True).to(x_TH.dtype)
                for impl_name, (build, node_aware) in EXCHANGES.items():
                    result = dict(model=model, routing=routing, impl=impl_name)
                    if shared and impl_name == "hf_all_to_all":
                        results.append(dict(result, status="not run: its DTensor mesh needs a GPU per rank"))
                        continue
                    found = build(mesh["ep"], mesh["tp"], nodes if node_aware else None, E)
                    if not found.available:
                        results.append(dict(result, status=found.reason))
                        continue
                    exchange = found.value
                    with count_sent_bytes(exchange.collectives) as sent:
                        y_TH = exchange.fn(x_TH, idx_TK, w_TK)
                    # Both exchanges with identity experts give sum_k w_k x_t: a check that they ran right.
                    stats = torch.tensor([sent[0], (y_TH.detach() - reference).abs().max().item() if s.tokens else 0.0],
                                         dtype=torch.float64, device=device)
                    dist.all_reduce(stats[:1])
                    dist.all_reduce(stats[1:], op=dist.ReduceOp.MAX)
                    ms_fwd, ms_fwd_bwd = _time_rank(s, exchange.fn, x_TH, idx_TK, w_TK, device)
                    local, kernels = (_local_gpu_ms(exchange.fn, x_TH, idx_TK, w_TK) if device.type == "cuda"
                                      else (None, []))
                    results.append(dict(result, measured_bytes=stats[0].item(), max_abs_err=stats[1].item(),
                                        ms_fwd=ms_fwd * 1e3, ms_fwd_bwd=ms_fwd_bwd * 1e3, local_gpu_ms=local,
                                        local_kernels=kernels, status="ok"))
        if rank == 0:
            Path(out_path).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(s: Settings, ep: int, backend: str) -> list[dict]:
    """Spawn ``ep`` processes, run the timed exchanges, return rank 0's results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.json")
        mp.start_processes(_worker, args=(ep, _free_port(), backend, threads_per_rank(ep), asdict(s), out_path),
                           nprocs=ep, start_method="spawn")
        return json.loads(Path(out_path).read_text())


# ---------------------------------------------------------------- report


def plot(report: Report, path: Path) -> None:
    rows = [r for r in report.rows if r.get("bytes_per_token") is not None]
    keys = list(dict.fromkeys((r["model"], r["routing"]) for r in rows))
    fig, axes = new_figure(2, max(1, len(keys)))
    for j, (model, routing) in enumerate(keys):
        for i, (col, label) in enumerate((("bytes_per_token", "bytes sent per token"),
                                          ("ms_fwd_bwd", "ms dispatch+combine fwd+bwd"))):
            ax = axes[i][j]
            width = 0.8 / len(EXCHANGES)
            for k, impl in enumerate(EXCHANGES):
                mine = [r for r in rows if (r["model"], r["routing"], r["impl"]) == (model, routing, impl)
                        and r.get(col) is not None]
                offset = (k - (len(EXCHANGES) - 1) / 2) * width
                ax.bar([m["ep"] + offset for m in mine], [m[col] for m in mine], width, label=impl)
            ax.set_xlabel("ep")
            ax.set_ylabel(label)
            ax.set_title(f"{model} (E={MODELS[model][0]}, k={MODELS[model][1]}), {routing}")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"dispatch+combine, {report.meta.get('device')}", fontsize=9)
    close_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ep", type=int_at_least(2), nargs="+", default=[2, 4, 8],
                        help="expert-parallel degrees (2 or more: one rank exchanges nothing)")
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--routing", nargs="+", choices=ROUTINGS, default=["uniform"])
    parser.add_argument("--tokens", type=int_at_least(1), help="tokens per rank (default 1024 on CPU, 4096 on CUDA)")
    parser.add_argument("--hidden", type=int_at_least(1), help="H (default 1024 on CPU, 4096 on CUDA)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--node-size", type=int_at_least(1), default=2,
                        help="ranks per simulated node: the node-aware rows run where ep spans several (default 2)")
    parser.add_argument("--no-timing", action="store_true", help="byte counts only, spawn no processes")


def pick_backend(device: torch.device, ep: int) -> tuple[str, str | None]:
    """NCCL when there is a GPU per rank; with fewer GPUs, the ranks share the first over gloo
    (NCCL refuses two ranks on one device); gloo on the CPU. Said so in the notes."""
    if device.type == "cuda" and torch.cuda.device_count() >= ep:
        return "nccl", None
    if device.type == "cuda":
        return SHARED_GPU, (f"ep={ep} with {torch.cuda.device_count()} GPU(s): the ranks share cuda:0 over gloo, "
                            f"which stages every exchange through the host, so 'ms' are not a network's; 'local GPU "
                            f"ms' is the slowest rank's own kernels in one fwd+bwd, host copies left out (an upper "
                            f"bound: the ranks' kernels take turns on the one GPU)")
    return "gloo", None


def check_arguments(args, device: torch.device) -> None:
    for model in args.models:
        E = MODELS[model][0]
        bad = [ep for ep in args.ep if ep < 1 or E % ep]
        if bad:
            raise ValueError(f"--ep values must divide the expert count E={E} of {model}, got {bad}")


def run(args, device: torch.device) -> Report:
    defaults = DEFAULTS[device.type]
    s = Settings(
        tokens=args.tokens or defaults["tokens"], hidden=args.hidden or defaults["hidden"],
        dtype=args.dtype or defaults["dtype"], models=tuple(args.models), routings=tuple(args.routing),
        seed=args.seed, warmup=args.warmup, reps=args.reps, node_size=args.node_size,
    )
    report = Report("dispatch", device, COLUMNS, plot=plot)
    report.meta = dict(environment(device), **asdict(s), ep=list(args.ep))
    report.notes.append("bytes/token: sent to other ranks in one forward dispatch+combine, averaged over all "
                        "ranks' tokens; 'measured' counts what each implementation's collectives actually sent")
    report.notes.append(f"network/token: the rows' bytes of that between simulated nodes of {s.node_size} ranks "
                        f"(ranks numbered node by node); moe_ep_node: the node-aware dispatch, where ep spans "
                        f"several nodes")
    report.notes.append("torch threads per rank: " + ", ".join(f"ep={ep}: {threads_per_rank(ep)}" for ep in args.ep))
    for ep in args.ep:
        backend, note = pick_backend(device, ep)
        if note:
            report.notes.append(note)
        timed = {}
        if not args.no_timing:
            print(f"[dispatch] ep={ep}: spawning {ep} {backend} ranks", flush=True)
            timed = {(r["model"], r["routing"], r["impl"]): r for r in run_ranks(s, ep, backend)}
        for model in s.models:
            for routing in s.routings:
                counted = computed_bytes(s, model, routing, ep)
                n_tokens = s.tokens * ep
                for impl in EXCHANGES:
                    if impl not in counted:
                        continue  # node-aware, ep within one node
                    row = dict(model=model, ep=ep, routing=routing, impl=impl,
                               rows_per_token=counted[impl].rows / n_tokens,
                               bytes_per_token=counted[impl].bytes / n_tokens,
                               bytes_vs_hf=counted[impl].bytes / counted["hf_all_to_all"].bytes,
                               network_bytes_per_token=counted[impl].network_bytes / n_tokens,
                               backend=None if args.no_timing else backend,
                               status="bytes only" if args.no_timing else None)
                    result = timed.get((model, routing, impl), {})
                    if "measured_bytes" in result:
                        row["measured_bytes_per_token"] = result["measured_bytes"] / n_tokens
                    row.update({k: result[k] for k in ("ms_fwd", "ms_fwd_bwd", "local_gpu_ms", "max_abs_err", "status")
                                if k in result})
                    report.rows.append(row)
                    if result.get("local_kernels"):
                        report.notes.append(f"local GPU kernels, {model} ep={ep} {routing} {impl}, rank 0's longest: "
                                            + "; ".join(f"{name[:60]} x{count} {ms:.3f} ms"
                                                        for name, count, ms in result["local_kernels"]))
    return report
