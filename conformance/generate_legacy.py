"""Record the legacy goldens of llama.cpp before session version 9 (llama-cpp-python 0.2.84 .. 0.2.90).

Runs under a virtual environment with that llama-cpp-python built from source (see conformance/README.md):

    /tmp/lcp02/bin/python conformance/generate_legacy.py            # every case of LEGACY_02_CASES
    /tmp/lcp02/bin/python conformance/generate_legacy.py -k mamba   # only matching cases
    /tmp/lcp02/bin/python conformance/generate_legacy.py --list
    /tmp/lcp0283/bin/python conformance/generate_legacy.py          # 0.2.83 (session v7): CASES_0_2_83
    /tmp/lcp0282/bin/python conformance/generate_legacy.py          # 0.2.82 (session v6): the same cases

Those bindings predate llama.cpp's memory API (``llama_memory_*``, ``llama_model_*``): shim_2024.py's
`install_shim` gives the module the names driver.py calls, each one the 2024 call that does the same, so that the
cases run the same scripts as every other golden (generate.py) and write the same case.json (see shim_2024.py, which
generate.py uses too for 0.3.0 .. 0.3.9). The context is seeded (`shim_2024.RNG_SEED`): the session files of this era
carry the sampler's random-number generator, which llama.cpp otherwise seeds from the clock, so a rerun writes
identical files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import llama_cpp as L  # noqa: E402
import shim_2024  # noqa: E402
from shim_2024 import RNG_SEED, install_shim, memory_block  # noqa: E402

# the cases replayed by the 2024 llama.cpp: one sequence with every artefact and restore, several sequences
# sharing cells (seq_cp, seq_rm), and a recurrent model
LEGACY_02_CASES = ("llama-f16-single-seq", "llama-shared-prefix", "mamba-seq-cp-rm")

# llama-cpp-python 0.2.83 (session v7, sequence v1: driver.PRODUCERS["0.2.83"]): its sequence saves abort on a
# recurrent cache (GGML_ASSERT), so it runs no Mamba case
CASES_0_2_83 = ("llama-f16-single-seq", "llama-shared-prefix")
# llama-cpp-python 0.2.82 (session v6: 0.2.83's bindings, shim and state code) refuses the tiny llama (its attn_q
# must be n_embd x n_embd; 4 heads of 32 make it 64 x 128) and the tiny bloom (no tied output): it runs 0.2.83's
# cases on stablelm-rot32-tiny (one head of 64 = n_embd), the one tiny attention model it loads (`derived_cases`)
CASES_0_2_82 = tuple(c.replace("llama", "stablelm-rot32") for c in CASES_0_2_83)
# the raw-KV releases (session v6 / v7), their cases
RAW_KV_CASES = {"0.2.67": CASES_0_2_82, "0.2.82": CASES_0_2_82, "0.2.83": CASES_0_2_83}
# not golden/: `kvref conformance` and the tests that walk golden/ read every artefact without a model, which
# session v7 needs (tests/test_legacy_v7.py reads these)
GOLDEN_DIR_0_2_83 = "golden-v7"


def shim_0_2_83() -> None:
    """0.2.83's state calls take no buffer size, and it has no llama_model_is_recurrent (only Mamba was)."""
    get, put, seq_get, seq_put = (
        L.llama_state_get_data, L.llama_state_set_data, L.llama_state_seq_get_data, L.llama_state_seq_set_data
    )  # fmt: skip
    L.llama_state_get_data = lambda ctx, dst, size: get(ctx, dst)
    L.llama_state_set_data = lambda ctx, src, size: put(ctx, src)
    L.llama_state_seq_get_data = lambda ctx, dst, size, seq_id: seq_get(ctx, dst, seq_id)
    L.llama_state_seq_set_data = lambda ctx, src, size, seq_id: seq_put(ctx, src, seq_id)
    L.llama_model_is_recurrent = lambda m: shim_2024.meta(m, "general.architecture") == "mamba"


def derived_cases(cases: list) -> list:
    """generate.CASES plus 0.2.82's: 0.2.83's cases, the same scripts and context, on stablelm-rot32-tiny."""
    import dataclasses

    by_id = {c.id: c for c in cases}
    extra = [
        dataclasses.replace(
            by_id[cid],
            id=cid.replace("llama", "stablelm-rot32"),
            model="stablelm-rot32",
            description=f"The {cid} operations on stablelm-rot32-tiny (llama-cpp-python 0.2.82 loads no tiny llama). "
            + by_id[cid].description,
        )
        for cid in CASES_0_2_83
    ]
    return [*cases, *extra]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="only cases whose id contains this text")
    ap.add_argument("--list", action="store_true", help="print the case ids and descriptions, record nothing")
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=Path.home() / ".cache" / "kvref-conformance-legacy",
        help="where the tiny GGUFs are written (default: %(default)s)",
    )
    a = ap.parse_args(argv)
    if not L.__version__.startswith("0.2."):
        raise SystemExit(f"run this under llama-cpp-python 0.2.x, not {L.__version__} (generate.py records the others)")
    raw_kv = L.__version__ in RAW_KV_CASES
    if raw_kv:
        shim_0_2_83()
    install_shim()
    import driver
    import generate

    generate.memory_block = memory_block
    driver.CAPTURE_GRAPHS = True  # capture.py declares this release's struct ggml_tensor too
    shim_2024.record_caches()
    ids = RAW_KV_CASES.get(L.__version__, LEGACY_02_CASES)
    cases = [c for c in derived_cases(generate.CASES) if c.id in ids and a.k in c.id]
    if a.list:
        for c in cases:
            print(f"{c.id:32s} {c.description}")
        return 0
    pr = driver.PRODUCER
    vers = {**generate.versions(), "rng": pr["rng"], "rng_seed": RNG_SEED, "seq_kv_ids": pr["seq_kv_ids"]}
    models = generate.build_models(a.model_dir, copy=False)
    for m in models.values():
        if m.committed and (HERE / "models" / m.path.name).exists():
            assert m.sha256 == driver.sha256(HERE / "models" / m.path.name), f"{m.name} differs from the committed one"
    for c in cases:
        doc = generate.run_case(c, models[c.model], vers, golden_dir=HERE / GOLDEN_DIR_0_2_83 if raw_kv else None)
        n_art = sum(1 for op in doc["trace"] if op["op"] == "save")
        print(f"legacy-{L.__version__}-{c.id:32s} {len(doc['trace']):3d} ops {n_art:3d} artefacts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
