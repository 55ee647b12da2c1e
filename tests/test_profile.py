"""kvref.profile: one behaviour table, profiles computed from it, and custom profiles for unseen builds."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from golden import load_case
from recurrent_helpers import mamba_hparams
from test_memory_factory import gemma2, jamba, llama

import kvref
from kvref import compat, profile
from kvref.errors import CompatError, KVRefError
from kvref.jobs.conformance import hparams_from_case
from kvref.memory.batch import Batch
from kvref.memory.factory import context_params, create_memory
from kvref.memory.hybrid import HybridMemory
from kvref.memory.kv_cache import KVCache
from kvref.memory.kv_state import ext_size, has_cell_ext
from kvref.memory.recurrent import RecurrentMemory
from kvref.profile import TABLE, Profile

# field -> the releases where its value changes (read off the sources; kvref.compat's docstring explains each)
BOUNDARIES = {
    "kv_streams": ["0.3.15"],
    "whole_restore_clear": ["0.3.15", "0.3.36"],
    "kv_seq_rm_all_asserts": ["0.3.15", "0.3.16"],
    "n_ctx_pad": ["0.3.17"],
    "n_kv_pad": ["0.3.17"],
    "n_batch_min": ["0.3.17"],
    "swa_size_pad": ["0.3.17"],
    "get_n_kv_pad": ["0.3.17"],
    "get_n_kv_streams": ["0.3.17"],
    "cell_ext_size": ["0.3.17", "0.3.36"],
    "cell_ext_ple": ["0.3.36"],
    "shift_refuses_mrope": ["0.3.17"],
    "kshift_skips_nope": ["0.3.35"],
    "seq_restore_contiguous": ["0.3.17"],
    "seq_save_keeps_masked_swa": ["0.3.26"],
    "decode_seq_id_bound": ["0.3.36"],
    "recurrent_seq_rm_rule": ["0.3.17"],
    "recurrent_seq_rm_checks_n_seq_max": ["0.3.36"],
    "recurrent_split_sequential": ["0.3.17"],
    "recurrent_restore_seq_bound": ["0.3.17"],
    "rs_rollback_archs": ["0.3.24", "0.3.36"],
    "recurrent_rows_from_src": ["0.3.24"],
    "recurrent_rollback_split": ["0.3.34"],
    "recurrent_rollback_single_use": ["0.3.36"],
    "hybrid_restore_undo": ["0.3.36"],
    "attn_rotation": ["0.3.36"],
    "kv_seq_save_ids": [],  # False only before 0.3.12 (kvref.compat.profile_2024)
}


def test_every_release_profile_changes_exactly_at_the_table_boundaries():
    profiles = [Profile.of(r) for r in profile.RELEASES]
    got = {
        f: [r.compat for prev, r in itertools.pairwise(profiles) if getattr(prev, f) != getattr(r, f)] for f in TABLE
    }
    assert got == BOUNDARIES
    for p in profiles:  # each value is TABLE's, nothing else decides it
        assert p.signature == tuple(profile.value_at(f, p.compat) for f in TABLE)
    # the named generations and the older behaviour names are read off the same table
    for name, release in profile.NAMED.items():
        assert Profile.of(name) == Profile.of(release) and Profile.of(name).compat == name
    assert compat.BEHAVIOURS == {
        compat.STREAMS: "0.3.15", compat.KV_SEQ_RM_ALL: "0.3.16", compat.GEN_2026: "0.3.17",
        compat.RS_ROLLBACK: "0.3.24", compat.SWA_SEQ_SKIP: "0.3.26", compat.RS_ROLLBACK_EQUAL_SPLIT: "0.3.34",
        compat.KSHIFT_SKIPS_NOPE: "0.3.35", compat.GEN_2026_10: "0.3.36",
    }  # fmt: skip
    assert {r for changes in BOUNDARIES.values() for r in changes} == set(compat.BEHAVIOURS.values())
    # Profile's defaults are the newest release's values
    assert Profile() == Profile.of(profile.RELEASES[-1]) == compat.for_llama_cpp_python(None)
    assert Profile().compat == "2026-10"


def test_profile_values_and_printing():
    p = compat.for_llama_cpp_python("0.3.20")
    assert isinstance(p, Profile) and p.compat == p.name == str(p) == "0.3.17"
    assert repr(p) == "Profile.of('0.3.17')" and eval(repr(p)) == p
    assert (p.cell_ext_size, p.n_kv_pad, p.seq_save_keeps_masked_swa, p.recurrent_seq_rm_rule) == (
        8, (1, 1), True, "cuts_tail")  # fmt: skip
    old = Profile.of("2025")
    assert (old.cell_ext_size, old.n_kv_pad, old.decode_seq_id_bound, old.recurrent_seq_rm_rule) == (
        0, (32, 256), "llama_max_seq_if_unified", "any_end_inside")  # fmt: skip
    assert hash(Profile.of("0.3.36")) == hash(Profile.of("2026-10"))  # equal: only the name differs
    assert kvref.Profile is Profile and "Profile" in kvref.__all__


def test_custom_profile_names():
    newest = compat.for_llama_cpp_python("0.3.36")
    custom = dataclasses.replace(newest, cell_ext_size=8)
    assert custom != newest and custom.compat == "custom"
    assert repr(custom) == "Profile(name='custom', cell_ext_size=8)" and eval(repr(custom)) == custom
    assert Profile(cell_ext_size=8) == custom
    assert dataclasses.replace(newest, cell_ext_size=12).compat == "2026-10"  # nothing changed
    # a custom profile that behaves as a known release is named after it
    assert dataclasses.replace(Profile.of("2026-08"), kshift_skips_nope=False).compat == "0.3.34"
    assert Profile(name="my-build", cell_ext_size=8).compat == "my-build"
    with pytest.raises(KVRefError, match="custom profile"):
        compat.since(custom, compat.GEN_2026)


def test_custom_profile_end_to_end_mrope_8_byte_ext():
    """A build kvref never saw: the newest llama.cpp but with the 8-byte cell ext (x, y)."""
    hp = hparams_from_case(load_case("qwen2vl-mrope"))
    custom = dataclasses.replace(compat.for_llama_cpp_python("0.3.36"), cell_ext_size=8)
    mem = create_memory(hp, 256, compat=custom)
    assert mem.profile is custom and mem.compat == "custom"
    assert (has_cell_ext(mem), ext_size(mem), mem.get_can_shift()) == (True, 8, False)
    batch = Batch(tokens=[1, 2, 3], seq_ids=[[0]] * 3)
    mem.decode(batch)
    (sec,) = mem.state_sections(0)
    assert sec.streams[0].cells.ext_size == 8
    blob = mem.state_write(0)
    newest = create_memory(hp, 256)
    newest.decode(batch)
    assert len(newest.state_write(0)) == len(blob) + 4 * 3  # 12-byte ext there: 4 more bytes a cell
    aug = create_memory(hp, 256, compat="2026-08")  # 0.3.35 writes the same 8-byte ext
    aug.decode(batch)
    assert aug.state_write(0) == blob
    other = create_memory(hp, 256, compat=custom)
    other.state_read(blob, 1)
    assert other.seq_pos_max(1) == 2
    with pytest.raises(KVRefError):
        create_memory(hp, 256).state_read(blob, 1)  # the 12-byte reader refuses it


def test_a_profile_reaches_every_part():
    custom = dataclasses.replace(Profile.of("2026-10"), seq_save_keeps_masked_swa=True)
    iswa = create_memory(gemma2(n_swa=4), 256, compat=custom)
    assert iswa.profile is custom and iswa.base.profile is custom and iswa.swa.profile is custom
    iswa.decode(Batch(tokens=list(range(13)), seq_ids=[[0]] * 13))
    base, swa = iswa.state_sections(0)
    assert (base.streams[0].cells.n, swa.streams[0].cells.n) == (13, 13)  # as 2025, the rest as 2026-10
    hyb = HybridMemory(jamba(), kv_size=256, rs_size=2, n_seq_max=2, compat=custom)
    assert hyb.attn.profile is custom and hyb.recr.profile is custom
    assert KVCache(llama(), compat="0.3.20").profile == Profile.of("0.3.17")
    rec = RecurrentMemory(mamba_hparams(), compat=dataclasses.replace(Profile(), recurrent_split_sequential=False))
    assert rec.profile.compat == "custom"


def test_unknown_compat_is_a_clear_kvref_error():
    for bad in ("2024", "0.3.11", "0.3.37", "latest", "", None, 2025):
        with pytest.raises(CompatError, match="unknown compat"):
            create_memory(llama(), 256, compat=bad)  # type: ignore[arg-type]
    with pytest.raises(CompatError, match=r"unknown compat '2024'.*named generation"):
        RecurrentMemory(mamba_hparams(), compat="2024")
    with pytest.raises(CompatError):
        context_params(llama(), 256, compat="2026-11")
    assert issubclass(CompatError, KVRefError) and issubclass(CompatError, ValueError)
    # a Profile with a value llama.cpp never had
    with pytest.raises(CompatError, match="cell_ext_size"):
        dataclasses.replace(Profile(), cell_ext_size=4)
    with pytest.raises(CompatError, match="recurrent_seq_rm_rule"):
        Profile(recurrent_seq_rm_rule="mid-2025")
    with pytest.raises(CompatError, match="n_kv_pad"):
        Profile(n_kv_pad=(0, 256))
