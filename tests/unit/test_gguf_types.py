"""kvserve.ops.gguf_types holds the gguf package's numbers, and starting kvserve does not import
the package (its import alone took 0.16 s of every start)."""

import subprocess
import sys

from gguf import constants

from kvserve.ops import gguf_types


def test_type_codes_and_block_sizes_are_the_packages():
    """Every type both know has the same code and block size (a newer package may know more)."""
    theirs = {
        t.name: (t.value, constants.GGML_QUANT_SIZES.get(t)) for t in constants.GGMLQuantizationType
    }
    ours = {
        t.name: (t.value, gguf_types.GGML_QUANT_SIZES[t]) for t in gguf_types.GGMLQuantizationType
    }
    common = ours.keys() & theirs.keys()
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"} <= common
    assert {n: ours[n] for n in common} == {n: theirs[n] for n in common}


def test_value_types_are_the_packages():
    assert {t.name: t.value for t in gguf_types.GGUFValueType} == {
        t.name: t.value for t in constants.GGUFValueType
    }


def test_loading_the_engine_does_not_import_the_gguf_package():
    code = (
        "import sys; "
        "import kvserve.engine.llm, kvserve.model.gguf_loader, kvserve.model.gguf_file; "
        "print('gguf' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
