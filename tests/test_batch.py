"""kvref.memory.batch against llama.cpp's src/llama-batch.cpp (llama_batch_compat::init, llama_batch_allocr).

Expected values are worked out by hand from the C++ (October 2026); each test names the rule.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvref.errors import BatchError, KVRefError
from kvref.memory.batch import (
    LLAMA_MAX_SEQ,
    Batch,
    BatchAllocr,
    UBatch,
    unordered_set_order,
)


class Mem:
    """A memory stub: seq id -> (pos_min, pos_max); absent sequences are empty (-1, -1)."""

    def __init__(self, ranges: dict[int, tuple[int, int]] | None = None) -> None:
        self.ranges = ranges or {}

    def seq_pos_min(self, s: int) -> int:
        return self.ranges.get(s, (-1, -1))[0]

    def seq_pos_max(self, s: int) -> int:
        return self.ranges.get(s, (-1, -1))[1]


def init(batch: Batch, mem=None, *, n_pos_per_embd: int = 1, **kw) -> BatchAllocr:
    a = BatchAllocr(n_pos_per_embd)
    kw.setdefault("n_vocab", 100)
    kw.setdefault("n_seq_max", 4)
    a.init(batch, mem, **kw)
    return a


def idxs(ubs: list[UBatch]) -> list[list[int]]:
    return [ub.batch_idxs.tolist() for ub in ubs]


# --------------------------------------------------------------------------------- Batch checks


def test_batch_requires_content_and_consistent_lengths():
    with pytest.raises(BatchError, match="neither token ids nor embeddings"):
        Batch()
    with pytest.raises(BatchError, match="n_tokens == 0"):
        Batch(tokens=[])
    with pytest.raises(BatchError, match="seq_ids has 1 entries"):
        Batch(tokens=[1, 2], seq_ids=[[0]])
    with pytest.raises(BatchError, match="logits has 3 entries"):
        Batch(tokens=[1, 2], logits=[1, 0, 1])
    with pytest.raises(BatchError, match="pos has 3 entries"):
        Batch(tokens=[1, 2], pos=[0, 1, 2])
    with pytest.raises(BatchError, match="embd has 1 rows"):
        Batch(tokens=[1, 2], embd=np.zeros((1, 4)))
    assert issubclass(BatchError, KVRefError) and issubclass(BatchError, ValueError)


# ------------------------------------------------------------------------ defaults (compat::init)


def test_defaults_seq0_positions_from_zero_last_output():
    a = init(Batch(tokens=[5, 6, 7]))
    assert a.pos.tolist() == [0, 1, 2]
    assert a.seq_id == [[0], [0], [0]]
    assert a.output.tolist() == [0, 0, 1]
    assert a.get_n_outputs() == 1
    assert a.seq_id_unq == [0] and a.seq_idx[0] == 0 and a.seq_idx[1] == -1


def test_positions_continue_after_memory_per_first_sequence():
    # pos_next[s] = memory.seq_pos_max(s) + 1, advanced only for the entry's first sequence id
    mem = Mem({0: (0, 4)})
    a = init(Batch(tokens=[1, 2, 3], seq_ids=[[0], [1], [0]]), mem)
    assert a.pos.tolist() == [5, 0, 6]


def test_auto_positions_advance_only_first_listed_sequence():
    # token 0 is in {0, 1} and takes pos_next[0]; token 1 (seq 1 only) still gets pos_next[1] = 0,
    # so sequence 1 sees position 0 twice, which init accepts (positions are a set; not decreasing)
    a = init(Batch(tokens=[1, 2], seq_ids=[[0, 1], [1]]))
    assert a.pos.tolist() == [0, 0]
    assert a.seq_pos[1] == {0}


def test_output_all_overrides_logits():
    a = init(Batch(tokens=[1, 2, 3], logits=[0, 1, 0]), output_all=True)
    assert a.output.tolist() == [1, 1, 1] and a.get_n_outputs() == 3
    b = init(Batch(tokens=[1, 2, 3], logits=[0, 1, 0]))
    assert b.output.tolist() == [0, 1, 0]


def test_seq_ids_follow_libstdcxx_unordered_set_order():
    a = init(Batch(tokens=[1], seq_ids=[[0, 1]]))
    assert a.seq_id == [[1, 0]]
    # so sequence 0 is the one marked coupled to the token's first id (1)
    assert a.seq_cpl[0, 1] and not a.seq_cpl[1, 0] and a.has_cpl
    b = init(Batch(tokens=[1], seq_ids=[[0, 1]]), seq_id_order="input")
    assert b.seq_id == [[0, 1]] and b.seq_cpl[1, 0]
    c = init(Batch(tokens=[1], seq_ids=[[2, 2, 0]]))
    assert c.seq_id == [[0, 2]] and c.n_seq_id.tolist() == [2]


# Iteration orders printed by g++ 12 (libstdc++) for std::unordered_set<int> after these inserts.
LIBSTDCXX_ORDERS = [
    ([0, 1], [1, 0]),
    ([0, 1, 2], [2, 1, 0]),
    ([2, 0, 1], [1, 0, 2]),
    ([0, 13], [13, 0]),
    ([0, 13, 26], [26, 13, 0]),
    (list(range(14)), [13, *range(13)]),
    ([5, 5, 3], [3, 5]),
    ([100, 3, 200, 3], [200, 3, 100]),
]


@pytest.mark.parametrize(("values", "expected"), LIBSTDCXX_ORDERS)
def test_unordered_set_order_matches_recorded_libstdcxx(values, expected):
    assert unordered_set_order(values) == expected


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to compare with libstdc++")
def test_unordered_set_order_matches_live_libstdcxx(tmp_path):
    src = tmp_path / "us.cpp"
    src.write_text(
        "#include <unordered_set>\n#include <cstdio>\n"
        'int main(){int n;while(scanf("%d",&n)==1){std::unordered_set<int> s;'
        'for(int i=0;i<n;++i){int v;scanf("%d",&v);s.insert(v);}std::unordered_set<int> c=s;'
        'for(int v:c)printf("%d ",v);printf("\\n");}}\n'
    )
    exe = tmp_path / "us"
    subprocess.run(["g++", "-O1", "-o", str(exe), str(src)], check=True)
    rng = np.random.default_rng(7)
    cases = [list(rng.integers(0, 256, size=k)) for k in (1, 2, 5, 13, 14, 29, 30, 60, 128, 300) for _ in range(20)]
    cases.append(list(range(256)))
    inp = "".join(f"{len(c)} {' '.join(map(str, c))}\n" for c in cases)
    out = subprocess.run([str(exe)], input=inp, capture_output=True, text=True, check=True).stdout.splitlines()
    for c, line in zip(cases, out, strict=True):
        assert unordered_set_order([int(x) for x in c]) == [int(x) for x in line.split()], c


# ------------------------------------------------------------------ validation (allocr::init)


def test_n_seq_max_above_limit():
    with pytest.raises(BatchError, match=r"n_seq_max = 257 > 256"):
        init(Batch(tokens=[1], pos=[0]), n_seq_max=LLAMA_MAX_SEQ + 1)


def test_mixed_content_types():
    with pytest.raises(BatchError, match="same content types"):
        init(Batch(tokens=[5, -1]))


def test_only_null_tokens_is_empty_content():
    with pytest.raises(BatchError, match="neither token ids nor embeddings"):
        init(Batch(tokens=[-1, -1]))


@pytest.mark.parametrize(("tokens", "msg"), [([0, 10], r"invalid token\[1\] = 10"), ([-2], r"invalid token\[0\] = -2")])
def test_token_out_of_vocab(tokens, msg):
    with pytest.raises(BatchError, match=msg):
        init(Batch(tokens=tokens), n_vocab=10)


def test_n_vocab_none_skips_upper_bound():
    assert init(Batch(tokens=[10**6]), n_vocab=None).token.tolist() == [10**6]


@pytest.mark.parametrize("bad", [2, -1])
def test_seq_id_out_of_range(bad):
    with pytest.raises(BatchError, match=rf"invalid seq_id\[1\]\[0\] = {bad} >= 2"):
        init(Batch(tokens=[1, 2], pos=[0, 0], seq_ids=[[0], [bad]]), n_seq_max=2)
    # without explicit positions the default-position table is indexed first; same error
    with pytest.raises(BatchError, match=rf"invalid seq_id\[1\]\[0\] = {bad} >= 2"):
        init(Batch(tokens=[1, 2], seq_ids=[[0], [bad]]), n_seq_max=2)


def test_empty_seq_id_list_rejected():
    with pytest.raises(BatchError, match="token 0 has no sequence id"):
        init(Batch(tokens=[1], seq_ids=[[]]))


def test_positions_must_continue_memory():
    mem = Mem({0: (0, 4)})
    init(Batch(tokens=[1], pos=[5]), mem)  # Y = X + 1
    with pytest.raises(BatchError, match=r"X = 4.*Y = 6.*remain consecutive: Y = X \+ 1"):
        init(Batch(tokens=[1], pos=[6]), mem)
    with pytest.raises(BatchError, match=r"X = 4.*Y = 4"):
        init(Batch(tokens=[1], pos=[4]), mem)
    # embeddings follow the same rule when there is one position per token
    with pytest.raises(BatchError, match="Y = X"):
        init(Batch(embd=np.zeros((1, 3)), pos=[4]), mem)


def test_positions_not_continuous():
    with pytest.raises(BatchError, match="sequence 0 positions are not continuous"):
        init(Batch(tokens=[1, 2], pos=[0, 2]))
    init(Batch(tokens=[1, 2, 3], pos=[0, 1, 1]))  # repeats are fine: the positions form a set


def test_mrope_token_positions_must_exceed_memory():
    mem = Mem({0: (0, 4)})
    init(Batch(tokens=[1, 2], pos=[9, 20]), mem, n_pos_per_embd=4)  # jumps allowed
    with pytest.raises(BatchError, match="for M-RoPE, it is required that the position satisfies: X < Y"):
        init(Batch(tokens=[1], pos=[4]), mem, n_pos_per_embd=4)


def test_mrope_embedding_positions_may_repeat_memory():
    mem = Mem({0: (0, 4)})
    # embedding batch: 4 blocks of n_tokens positions
    init(Batch(embd=np.zeros((2, 3)), pos=[4, 4, 0, 0, 0, 1, 0, 0]), mem, n_pos_per_embd=4)
    with pytest.raises(BatchError, match="X <= Y"):
        init(Batch(embd=np.zeros((2, 3)), pos=[3, 4, 0, 0, 0, 0, 0, 0]), mem, n_pos_per_embd=4)
    with pytest.raises(BatchError, match="n_pos_per_embd \\* n_tokens = 8"):
        init(Batch(embd=np.zeros((2, 3)), pos=[5, 6]), mem, n_pos_per_embd=4)


def test_coupled_sequences_that_diverged():
    # both sequences end at 4 (so Y = X + 1 holds for both) but start differently
    mem = Mem({0: (0, 4), 1: (2, 4)})
    # libstdc++ order puts 1 first, so 0 is the sequence coupled to 1
    with pytest.raises(BatchError, match="sequence 0 is coupled to 1 in the input batch, but have diverged"):
        init(Batch(tokens=[1], pos=[5], seq_ids=[[0, 1]]), mem)
    with pytest.raises(BatchError, match="sequence 1 is coupled to 0"):
        init(Batch(tokens=[1], pos=[5], seq_ids=[[0, 1]]), mem, seq_id_order="input")
    init(Batch(tokens=[1], pos=[5], seq_ids=[[0, 1]]), Mem({0: (2, 4), 1: (2, 4)}))


def test_decreasing_positions():
    # the example of llama-batch.cpp: pos 4 5 0 1 6 2 3, seq 0 0 1 1 0 1 0 -> fails at token 6
    with pytest.raises(BatchError, match="sequence 0 positions are decreasing"):
        init(Batch(tokens=[1] * 7, pos=[4, 5, 0, 1, 6, 2, 3], seq_ids=[[0], [0], [1], [1], [0], [1], [0]]))
    with pytest.raises(BatchError, match="sequence 0 positions are decreasing"):
        init(Batch(tokens=[1, 2], pos=[1, 0]))  # a set-wise continuous batch, one step back


def test_partial_subset_rule_cannot_fire():
    # llama.cpp's comment calls {0,1,2} {0,1} {1,2} invalid, but its check intersects each
    # sequence's running set with sets that always contain that sequence, so it never empties:
    # the batch is accepted (the splitters then keep the sets apart)
    a = init(Batch(tokens=[1, 2, 3], pos=[0, 1, 1], seq_ids=[[0, 1, 2], [0, 1], [1, 2]]))
    assert [ub.batch_idxs.tolist() for ub in a.split_all("seq", 8)] == [[0, 1], [2]]


def test_embd_width_must_match_decoder():
    with pytest.raises(BatchError, match="embd row width 3 does not match the decoder input 4"):
        init(Batch(embd=np.zeros((1, 3))), n_embd=4)


# ---------------------------------------------------------------------------- bookkeeping


def test_seq_sets_and_maps():
    a = init(Batch(tokens=[1, 2, 3, 4], pos=[0, 0, 1, 1], seq_ids=[[0, 2], [1], [0, 2], [1]]))
    s02, s1 = (1 << 0) | (1 << 2), 1 << 1
    assert a.seq_set == [s02, s1, s02, s1]
    assert a.seq_set_map == {s02: [0, 2], s1: [1, 3]}
    assert a.seq_id_unq == [0, 1, 2] and a.seq_idx[:4].tolist() == [0, 1, 2, -1]
    assert (a.seq_pos_min(2), a.seq_pos_max(2), a.seq_pos_min(3)) == (0, 1, -1)


# ------------------------------------------------------------------------------ splitters


def test_split_simple_chunks_in_order():
    a = init(Batch(tokens=[1, 2, 3, 4, 5], seq_ids=[[0], [1], [0], [1], [0]], pos=[0, 0, 1, 1, 2]))
    ubs = a.split_all("simple", 2)
    assert idxs(ubs) == [[0, 1], [2, 3], [4]]
    ub = ubs[0]
    assert (ub.equal_seqs, ub.n_tokens, ub.n_seq_tokens, ub.n_seqs, ub.n_seqs_unq) == (False, 2, 1, 2, 2)
    assert ub.seq_id_unq == [0, 1] and ub.seq_idx[:2].tolist() == [0, 1]
    assert a.get_n_used() == 5
    assert a.split_simple(2).n_tokens == 0  # exhausted


def test_split_equal_sequential_interleaves_by_sequence():
    a = init(Batch(tokens=[1, 2, 3, 4, 5], seq_ids=[[0], [1], [0], [1], [0]], pos=[0, 0, 1, 1, 2]))
    ubs = a.split_all("equal", 4, sequential=True)
    # round 1 takes one token of each set, (1+1)*2 <= 4 so round 2 too, then (2+1)*2 > 4 stops
    assert idxs(ubs) == [[0, 2, 1, 3], [4]]
    assert (ubs[0].n_seqs, ubs[0].n_seq_tokens, ubs[0].equal_seqs) == (2, 2, True)
    assert ubs[0].pos.tolist() == [0, 1, 0, 1]
    assert ubs[0].seq_id == [[0], [0], [1], [1]]


def test_split_equal_sequential_needs_consecutive_ids():
    a = init(Batch(tokens=[1, 2], seq_ids=[[1], [0]], pos=[0, 0]))
    assert idxs(a.split_all("equal", 8, sequential=True)) == [[0], [1]]
    assert idxs(a.split_all("equal", 8, sequential=False)) == [[0, 1]]


def test_split_equal_sequential_refuses_coupled_sequences():
    a = init(Batch(tokens=[1, 2], seq_ids=[[0, 1], [0, 1]], pos=[0, 1]))
    assert a.split_equal(8, True).n_tokens == 0
    assert a.split_whole("equal", 8, sequential=True) is None  # "failed to find a suitable split"
    assert idxs(a.split_whole("simple", 8)) == [[0, 1]]


def test_split_equal_shared_sets():
    a = init(Batch(tokens=[1, 2, 3, 4], pos=[0, 1, 2, 2], seq_ids=[[0, 1], [0, 1], [0], [1]]))
    ubs = a.split_all("equal", 8)
    assert idxs(ubs) == [[0, 1], [2, 3]]
    assert (ubs[0].n_seqs, ubs[0].n_seq_tokens, ubs[0].seq_id_unq) == (1, 2, [0, 1])
    assert (ubs[1].n_seqs, ubs[1].n_seq_tokens) == (2, 1)


def test_split_equal_uneven_lengths_and_small_ubatch():
    # seq 0: tokens 0..4, seq 1: tokens 5..7
    a = init(Batch(tokens=[1] * 8, pos=[0, 1, 2, 3, 4, 0, 1, 2], seq_ids=[[0]] * 5 + [[1]] * 3))
    # the ubatch concatenates each set's tokens; a set that runs out stops the growth of all sets
    assert idxs(a.split_all("equal", 4, sequential=True)) == [[0, 1, 5, 6], [2, 7], [3, 4]]


def test_split_equal_can_exceed_n_ubatch_by_one_sequence():
    # more sets than n_ubatch: llama.cpp stops collecting at n_ubatch + 1 sets, one token each
    a = init(Batch(tokens=[1, 2, 3], pos=[0, 0, 0], seq_ids=[[0], [1], [2]]))
    ub = a.split_equal(2, False)
    assert ub.n_tokens == 3 and ub.n_seqs == 3 and ub.n_seq_tokens == 1


def test_split_equal_keep_tail_defers_and_completes():
    a = init(Batch(tokens=[1] * 8, pos=[0, 1, 2, 3, 4, 0, 1, 2], seq_ids=[[0]] * 5 + [[1]] * 3))
    ubs = a.split_all("equal", 4, sequential=True, n_keep_tail=2)
    # 1st: seq 1 would leave 1 (< 2) token behind -> deferred; 2nd: seq 0 alone leaves 1 -> finished
    assert idxs(ubs) == [[0, 1], [2, 3, 4], [5, 6, 7]]


def test_split_equal_keep_tail_truncates():
    a = init(Batch(tokens=[1] * 6))
    assert idxs(a.split_all("equal", 4, sequential=True, n_keep_tail=3)) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError):
        a.split_all("equal", 3, sequential=True, n_keep_tail=3)


def test_split_seq_narrows_to_subsets():
    a = init(Batch(tokens=[1, 2, 3, 4], pos=[0, 1, 1, 2], seq_ids=[[0, 1], [0], [1], [0, 1]]))
    ubs = a.split_all("seq", 8)
    assert idxs(ubs) == [[0, 1], [2], [3]]
    assert all(ub.n_seqs == 1 and ub.equal_seqs for ub in ubs)
    assert ubs[0].n_seq_tokens == 2 and ubs[0].seq_id_unq == [0, 1]
    assert idxs(a.split_all("seq", 1)) == [[0], [1], [2], [3]]


def test_out_ids_follow_split_order():
    a = init(Batch(tokens=[1, 2, 3, 4], seq_ids=[[0], [1], [0], [1]], pos=[0, 0, 1, 1], logits=[1, 1, 0, 1]))
    ubs = a.split_all("equal", 8, sequential=True)
    assert idxs(ubs) == [[0, 2, 1, 3]]
    assert ubs[0].output.tolist() == [1, 0, 1, 1]
    assert a.get_out_ids() == [0, 1, 3]


def test_mrope_token_positions_are_broadcast():
    a = init(Batch(tokens=[1, 2, 3]), n_pos_per_embd=4)
    ub = a.split_simple(2)
    assert ub.n_pos == 4 and ub.is_pos_2d()
    assert ub.pos.tolist() == [0, 1] * 4


def test_mrope_embedding_positions_copied_per_section():
    pos = [0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32]  # 4 sections x 3 tokens
    a = init(Batch(embd=np.arange(6, dtype=np.float32).reshape(3, 2), pos=pos), n_pos_per_embd=4)
    ub = a.split_all("simple", 2)[1]
    assert ub.batch_idxs.tolist() == [2] and ub.pos.tolist() == [2, 12, 22, 32]
    assert ub.token is None and ub.embd.tolist() == [[4.0, 5.0]]


def test_embedding_without_positions_gets_zero_extra_sections():
    a = init(Batch(embd=np.zeros((2, 2))), n_pos_per_embd=4)
    assert a.pos.tolist() == [0, 1, 0, 0, 0, 0, 0, 0]


def test_split_whole_runs_the_splitter_a_memory_picks():
    b = Batch(tokens=[1, 2, 3, 4], seq_ids=[[0], [1], [0], [1]], pos=[0, 0, 1, 1], logits=[1, 1, 1, 1])
    a = init(b)
    assert idxs(a.split_whole("simple", 8)) == [[0, 1, 2, 3]]  # one-stream KV cache, iSWA's first try
    assert idxs(a.split_whole("equal", 8, sequential=True)) == [[0, 2, 1, 3]]  # several streams
    assert idxs(a.split_whole("seq", 8)) == [[0, 2], [1, 3]]  # recurrent / hybrid with every token an output
    # n_rs_seq = 1 keeps the last 2 tokens of each sequence together
    assert idxs(a.split_whole("equal", 3, sequential=False, n_keep_tail=2)) == [[0, 2], [1, 3]]


def test_ubatch_reserve():
    a = init(Batch(tokens=[1, 2]), n_pos_per_embd=4)
    ub = a.ubatch_reserve(3, 2)
    assert (ub.n_tokens, ub.n_seq_tokens, ub.n_seqs, ub.n_seqs_unq, ub.equal_seqs) == (6, 3, 2, 2, True)
    assert ub.pos.shape == (24,) and ub.seq_id_unq == [0, 1] and ub.seq_idx[:3].tolist() == [0, 1, -1]
    assert a.get_n_tokens() == 0  # the allocator was cleared


def test_empty_ubatch_shape():
    ub = UBatch.empty()
    assert ub.n_tokens == 0 and ub.seq_idx.shape == (LLAMA_MAX_SEQ,)


# --------------------------------------------------------------------------- properties


@st.composite
def batches(draw):
    n_seq = draw(st.integers(1, 4))
    n = draw(st.integers(1, 14))
    sets = [sorted(draw(st.sets(st.integers(0, n_seq - 1), min_size=1, max_size=n_seq))) for _ in range(n)]
    # a position consistent for every sequence of the token: one past the furthest of them
    nxt = [0] * n_seq
    pos = []
    for ids in sets:
        p = max(nxt[s] for s in ids)
        pos.append(p)
        for s in ids:
            nxt[s] = p + 1
    logits = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return Batch(tokens=list(range(n)), pos=pos, seq_ids=sets, logits=logits), n_seq


def _check_ubatches(a: BatchAllocr, ubs: list[UBatch], n_ubatch: int) -> None:
    n = a.get_n_tokens()
    flat = [i for ub in ubs for i in ub.batch_idxs.tolist()]
    assert sorted(flat) == list(range(n))  # every token exactly once
    outs = [i for ub in ubs for i in ub.batch_idxs.tolist() if a.output[i]]
    assert a.get_out_ids() == outs
    for ub in ubs:
        ix = ub.batch_idxs
        assert ub.n_tokens == len(ix) == ub.n_seqs * ub.n_seq_tokens
        assert ub.n_tokens <= max(n_ubatch, ub.n_seqs)
        assert ub.token.tolist() == a.token[ix].tolist()
        assert ub.pos.tolist() == a.pos[ix].tolist()
        assert ub.output.tolist() == a.output[ix].tolist()
        assert ub.seq_id == [a.seq_id[i] for i in ix]
        unq = sorted({s for i in ix for s in a.seq_id[i]})
        assert ub.seq_id_unq == unq and ub.n_seqs_unq == len(unq)
        assert [int(ub.seq_idx[s]) for s in unq] == list(range(len(unq)))
        assert int((ub.seq_idx >= 0).sum()) == len(unq)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(batches(), st.integers(1, 6), st.sampled_from(["simple", "equal", "equal_seq", "seq"]))
def test_splits_partition_the_batch(bn, n_ubatch, kind):
    batch, n_seq = bn
    a = BatchAllocr()
    try:
        a.init(batch, None, n_vocab=100, n_seq_max=n_seq)
    except BatchError:
        assume(False)
    if kind == "equal_seq":
        assume(not a.has_cpl)
        ubs = a.split_all("equal", n_ubatch, sequential=True)
    else:
        ubs = a.split_all(kind, n_ubatch)
    assert a.get_n_used() == a.get_n_tokens()
    _check_ubatches(a, ubs, n_ubatch)
    if kind == "simple":
        assert [i for ub in ubs for i in ub.batch_idxs.tolist()] == list(range(a.get_n_tokens()))
    for ub in ubs:
        blocks = [ub.batch_idxs[k * ub.n_seq_tokens : (k + 1) * ub.n_seq_tokens] for k in range(ub.n_seqs)]
        if kind.startswith("equal"):
            # each block is one sequence set, and the sets of a ubatch do not overlap
            sets = [{a.seq_set[i] for i in blk} for blk in blocks]
            assert all(len(s) == 1 for s in sets)
            masks = [next(iter(s)) for s in sets]
            assert all(m1 & m2 == 0 for k, m1 in enumerate(masks) for m2 in masks[k + 1 :])
        if kind == "seq":
            first = a.seq_set[int(ub.batch_idxs[0])]
            assert all(a.seq_set[i] & first == a.seq_set[i] for i in ub.batch_idxs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=0, max_size=40))
def test_unordered_set_order_is_a_permutation_of_the_distinct_values(values):
    out = unordered_set_order(values)
    assert sorted(out) == sorted(set(values))
