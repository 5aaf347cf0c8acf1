import pytest
import torch

from moe_ep.kernels.routing_metadata import padded_rows, routing_metadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def expected_metadata(idx, num_experts, pad_m):
    """The same metadata from plain torch ops on the host."""
    flat = idx.reshape(-1).long().cpu()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + pad_m - 1) // pad_m * pad_m
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)])
    order = torch.sort(flat, stable=True).indices
    rank_in_expert = torch.arange(flat.numel()) - torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])[flat[order]]
    sorted_slot = torch.full((padded_rows(flat.numel(), num_experts, pad_m),), -1, dtype=torch.long)
    pos = offsets[flat[order]] + rank_in_expert
    sorted_slot[pos] = order
    slot_pos = torch.empty_like(flat)
    slot_pos[order] = pos
    num_blocks = sorted_slot.numel() // pad_m
    block_expert = torch.full((num_blocks,), -1, dtype=torch.long)
    for e in range(num_experts):
        block_expert[offsets[e] // pad_m: offsets[e + 1] // pad_m] = e
    return counts, offsets, sorted_slot, slot_pos, block_expert


def random_idx(T, E, K, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    if skew:
        scores[:, 0] += 1.0  # expert 0 in every token's choice
    return scores.topk(K, dim=-1).indices


CASES = [
    # (T, E, K, pad_m, idx dtype, skew): several chunks, E beyond one expert tile, k = 1 and k = E,
    # one hot expert, pad_m 1 (no padding) and pad_m larger than every count.
    (700, 5, 2, 16, torch.int64, False),
    (300, 40, 3, 8, torch.int32, False),
    (130, 4, 4, 64, torch.int64, False),
    (257, 8, 1, 32, torch.int32, True),
    (50, 3, 1, 1, torch.int64, False),
    (1, 6, 2, 128, torch.int64, False),
    # More histogram rows than one scan step (64 chunks of 256 slots) and more blocks than one
    # block-table step (256).
    (8300, 20, 2, 16, torch.int32, False),
]


@pytest.mark.parametrize("T,E,K,pad_m,dtype,skew", CASES)
def test_metadata_matches_torch(T, E, K, pad_m, dtype, skew):
    idx = random_idx(T, E, K, seed=T + E, skew=skew).to(dtype)
    meta = routing_metadata(idx.to(DEVICE), E, pad_m)
    counts, offsets, sorted_slot, slot_pos, block_expert = expected_metadata(idx, E, pad_m)
    assert meta.pad_m == pad_m
    for got, want in [
        (meta.counts_E, counts),
        (meta.padded_offsets_E1, offsets),
        (meta.sorted_slot_P, sorted_slot),
        (meta.slot_pos_N, slot_pos),
        (meta.block_expert_B, block_expert),
    ]:
        assert got.dtype == torch.int32
        assert torch.equal(got.cpu().long(), want)


def test_empty_experts_and_no_slots():
    idx = torch.tensor([[2, 2], [2, 0]]).view(2, 2)
    meta = routing_metadata(idx.to(DEVICE), 5, 4)
    assert meta.counts_E.tolist() == [1, 0, 3, 0, 0]
    assert meta.padded_offsets_E1.tolist() == [0, 4, 4, 8, 8, 8]
    assert meta.block_expert_B.tolist()[:3] == [0, 2, -1]
    empty = routing_metadata(torch.empty(0, 2, dtype=torch.long, device=DEVICE), 5, 4)
    assert empty.counts_E.tolist() == [0] * 5 and empty.padded_offsets_E1.tolist() == [0] * 6
    assert empty.sorted_slot_P.numel() == 0 and empty.slot_pos_N.numel() == 0 and empty.block_expert_B.numel() == 0


def test_bad_arguments():
    idx = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(TypeError, match="idx must be int32 or int64, got torch.float32"):
        routing_metadata(idx.float(), 4, 16)
    with pytest.raises(ValueError, match="num_experts must be a positive int, got 0"):
        routing_metadata(idx, 0, 16)
    with pytest.raises(ValueError, match="pad_m must be a power of two, got 24"):
        routing_metadata(idx, 4, 24)


@pytest.mark.parametrize("num_routed", ["exact", "loose"])
def test_slots_without_an_expert_get_no_row(num_routed):
    """Id ``E`` is "no expert": such a slot has no padded row (``slot_pos`` = P) and the other
    slots' metadata is what it would be without it, in a layout sized by ``num_routed``."""
    T, E, K, pad_m = 300, 6, 3, 16
    idx = random_idx(T, E, K, seed=3)
    empty = torch.rand(T, K, generator=torch.Generator().manual_seed(4)) < 0.4
    with_empty = torch.where(empty, E, idx)
    routed = int((~empty).sum()) + (0 if num_routed == "exact" else 9)
    meta = routing_metadata(with_empty.to(DEVICE), E, pad_m, routed)
    P = padded_rows(routed, E, pad_m)
    assert meta.sorted_slot_P.numel() == P and meta.block_expert_B.numel() == P // pad_m
    slot_pos = meta.slot_pos_N.cpu().long()
    assert torch.all(slot_pos[empty.reshape(-1)] == P)
    # The routed slots: sorted by expert in slot order, as the metadata of their ids alone.
    counts = torch.bincount(idx[~empty], minlength=E)
    assert torch.equal(meta.counts_E.cpu().long(), counts)
    sorted_slot = meta.sorted_slot_P.cpu().long()
    real = sorted_slot[sorted_slot >= 0]
    assert torch.equal(real.sort().values, torch.nonzero(~empty.reshape(-1)).reshape(-1))
    assert torch.equal(sorted_slot[slot_pos[~empty.reshape(-1)]], torch.nonzero(~empty.reshape(-1)).reshape(-1))
    experts_in_order = with_empty.reshape(-1)[real]
    assert torch.all(experts_in_order[1:] >= experts_in_order[:-1])


def test_bad_num_routed():
    idx = torch.zeros(3, 2, dtype=torch.long)
    for bad in (-1, 7, 2.0, True):
        with pytest.raises(ValueError, match=r"num_routed must be None or an int in \[0, 6\]"):
            routing_metadata(idx, 4, 16, bad)
