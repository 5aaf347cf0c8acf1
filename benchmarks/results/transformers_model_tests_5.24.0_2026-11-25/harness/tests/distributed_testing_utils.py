# Reconstructed (not in the sdist): what test_fsdp_mixin / test_expert_parallel_mixin import.
import functools
import torch
import torch.multiprocessing as mp


def _get_distributed_device_type():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_distributed_backend():
    return "nccl" if torch.cuda.is_available() else "gloo"


def _get_rank_device(rank):
    return torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")


def _set_rank_device(rank):
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)


def _start_rank_processes(fn, args=(), nprocs=1):
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="spawn")


def run_distributed(world_size):
    raise NotImplementedError("run_distributed is not reconstructed in this harness")
