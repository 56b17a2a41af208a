"""Choosing the C kernels' ISA build (kvserve.ops.cpu_kernels): the host's builds from its CPU
flags, KVSERVE_ISA forcing one, KVSERVE_NO_C_KERNELS, the startup log line, and a build without
OpenMP."""

import logging
import platform
import shutil

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import quantize

from kvserve.model.quant import BlockTensor, pack_gguf_rows
from kvserve.ops import cpu_kernels

needs_cc = pytest.mark.skipif(
    cpu_kernels._compiler() is None and shutil.which("gcc") is None, reason="no C compiler"
)
HOST_ISAS = cpu_kernels.host_isas()


@pytest.fixture(autouse=True)
def _fresh_cpu_facts():
    """host_isas() caches what the CPU reports: tests that fake the CPU start and end clean."""
    cpu_kernels._host_isas.cache_clear()
    yield
    cpu_kernels._host_isas.cache_clear()


@pytest.fixture(autouse=True)
def fresh_kernels(monkeypatch):
    """No ISA forced, C kernels on, nothing loaded: each test starts from a clean state."""
    monkeypatch.delenv("KVSERVE_ISA", raising=False)
    monkeypatch.delenv("KVSERVE_NO_C_KERNELS", raising=False)
    cpu_kernels._load.cache_clear()
    yield
    cpu_kernels._load.cache_clear()


def test_host_isas_best_first_portable_last():
    isas = cpu_kernels.host_isas()
    assert isas[-1] == "portable"
    assert len(set(isas)) == len(isas) and set(isas) <= set(cpu_kernels.ISAS)
    assert isas == [i for i in cpu_kernels.ISAS if i in isas]  # ISAS is best first
    assert cpu_kernels.ISAS[-1] == "portable"
    assert cpu_kernels.selected_isa() == isas[0]  # unforced: the best


@needs_cc
@pytest.mark.parametrize("isa", HOST_ISAS)
def test_forcing_an_isa_loads_that_build(monkeypatch, isa):
    monkeypatch.setenv("KVSERVE_ISA", f" {isa.upper()} ")  # case and spaces do not matter
    assert cpu_kernels.selected_isa() == isa
    lib = cpu_kernels.library()
    if lib is None:
        pytest.skip("C kernels unavailable")
    name = lib.gguf_gemv_isa()
    assert isinstance(name, bytes) and name.decode() == isa
    assert lib is cpu_kernels.library(isa)


@pytest.mark.parametrize(
    "alias,isa",
    [("avx512", "avx512vnni"), ("AVX512_VNNI", "avx512vnni"), ("arm", "neon"), ("c", "portable")],
)
def test_aliases(monkeypatch, alias, isa):
    monkeypatch.setenv("KVSERVE_ISA", alias)
    if isa in HOST_ISAS:
        assert cpu_kernels.selected_isa() == isa
    else:  # a valid name for a build this CPU cannot run
        with pytest.raises(ValueError, match=isa):
            cpu_kernels.selected_isa()


def test_unknown_isa_is_an_error_listing_the_builds(monkeypatch):
    monkeypatch.setenv("KVSERVE_ISA", "sse9")
    with pytest.raises(ValueError, match="sse9") as e:
        cpu_kernels.selected_isa()
    for isa in cpu_kernels.ISAS:
        assert isa in str(e.value)
    with pytest.raises(ValueError):
        cpu_kernels.library()


def test_isa_the_cpu_cannot_run_is_an_error_listing_what_it_runs(monkeypatch):
    foreign = [i for i in cpu_kernels.ISAS if i not in HOST_ISAS]
    assert foreign, "every CPU lacks some build (x86: neon; Arm: avx2)"
    for isa in foreign:
        monkeypatch.setenv("KVSERVE_ISA", isa)
        with pytest.raises(ValueError, match="cannot execute") as e:
            cpu_kernels.selected_isa()
        for ok in HOST_ISAS:
            assert ok in str(e.value)
        with pytest.raises(ValueError):
            cpu_kernels.library()


@needs_cc
def test_no_c_kernels_env(monkeypatch):
    monkeypatch.setenv("KVSERVE_NO_C_KERNELS", "1")
    assert not cpu_kernels.available()
    assert cpu_kernels.library("portable") is None
    monkeypatch.setenv("KVSERVE_NO_C_KERNELS", "0")
    if cpu_kernels.library() is None:
        pytest.skip("C kernels unavailable")
    assert cpu_kernels.available()


@needs_cc
@pytest.mark.parametrize("isa", HOST_ISAS)
def test_startup_log_names_the_build(monkeypatch, caplog, isa):
    monkeypatch.setenv("KVSERVE_ISA", isa)
    caplog.set_level(logging.INFO, logger="kvserve")
    if cpu_kernels.library() is None:
        pytest.skip("C kernels unavailable")
    lines = [
        r.getMessage() for r in caplog.records if r.name == "kvserve" and r.levelno == logging.INFO
    ]
    assert any(f"{isa} build" in line and f"gguf_gemv_{isa}.c" in line for line in lines), lines
    caplog.clear()
    cpu_kernels.library()  # loaded once: no second line
    assert not [r for r in caplog.records if "C kernels" in r.getMessage()]


# ---------------------------------------------------------------- the CPU-flag parser

ZEN3 = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
    "sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc "
    "cpuid extd_apicid aperfmperf rapl pni pclmulqdq monitor ssse3 fma cx16 sse4_1 sse4_2 x2apic "
    "movbe popcnt aes xsave avx f16c rdrand lahf_lm cmp_legacy svm extapic cr8_legacy abm sse4a "
    "misalignsse 3dnowprefetch osvw ibs skinit wdt tce topoext perfctr_core perfctr_nb bpext "
    "perfctr_llc mwaitx cpb cat_l3 cdp_l3 hw_pstate ssbd mba ibrs ibpb stibp vmmcall fsgsbase bmi1 "
    "avx2 smep bmi2 erms invpcid cqm rdt_a rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec "
    "xgetbv1 xsaves cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local clzero irperf xsaveerptr "
    "rdpru wbnoinvd arat npt lbrv svm_lock nrip_save tsc_scale vmcb_clean flushbyasid "
    "decodeassists pausefilter pfthreshold v_vmsave_vmload vgif v_spec_ctrl umip pku ospke vaes "
    "vpclmulqdq rdpid overflow_recov succor smca fsrm"
)
ICELAKE = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
    "sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc "
    "cpuid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt "
    "tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch "
    "invpcid_single ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 avx2 smep bmi2 "
    "erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni "
    "avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves wbnoinvd ida arat avx512vbmi pku ospke "
    "avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq la57 rdpid "
    "md_clear flush_l1d arch_capabilities"
)
SKYLAKE_X = (
    "fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 popcnt aes xsave avx f16c bmi1 avx2 bmi2 avx512f "
    "avx512dq avx512cd avx512bw avx512vl"
)  # AVX-512 without VNNI
SANDY_BRIDGE = "fpu sse sse2 ssse3 cx16 sse4_1 sse4_2 popcnt aes xsave avx"
ALDER_LAKE = (
    "fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 popcnt aes xsave avx f16c bmi1 avx2 bmi2 sha_ni "
    "gfni vaes vpclmulqdq avx_vnni movdiri movdir64b serialize"
)  # AVX-VNNI, no AVX-512
ZEN5 = ICELAKE + " avx_vnni avx512_bf16"
GRAVITON2 = (
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm "
    "lrcpc dcpop asimddp ssbs"
)
CORTEX_A72 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid"


def fake_cpuinfo(machine, flags):
    key = "Features" if machine == "aarch64" else "flags"
    head = (
        "processor\t: 0\nBogoMIPS\t: 50.00\n"
        if machine == "aarch64"
        else "processor\t: 0\nvendor_id\t: SomeVendor\nmodel name\t: Some CPU\nfpu\t\t: yes\n"
    )
    return head + f"{key}\t\t: {flags}\n\nprocessor\t: 1\n{key}\t\t: {flags}\n"


@pytest.mark.parametrize(
    "machine,flags,isas",
    [
        ("x86_64", ZEN3, ["avx2", "portable"]),
        ("x86_64", ICELAKE, ["avx512vnni", "avx2", "portable"]),
        ("AMD64", ICELAKE, ["avx512vnni", "avx2", "portable"]),
        ("x86_64", SKYLAKE_X, ["avx2", "portable"]),
        ("x86_64", SANDY_BRIDGE, ["portable"]),
        ("x86_64", ALDER_LAKE, ["avxvnni", "avx2", "portable"]),
        ("x86_64", ZEN5, ["avx512vnni", "avxvnni", "avx2", "portable"]),
        ("aarch64", GRAVITON2, ["neon", "portable"]),
        ("aarch64", CORTEX_A72, ["portable"]),
        ("x86_64", GRAVITON2, ["portable"]),  # Arm flags on x86: nothing
        ("aarch64", ICELAKE, ["portable"]),  # x86 flags on Arm: nothing
    ],
    ids=[
        "zen3",
        "icelake",
        "icelake-amd64",
        "skylake-x",
        "sandy-bridge",
        "alder-lake",
        "zen5",
        "graviton2",
        "cortex-a72",
        "x86-armflags",
        "arm-x86flags",
    ],
)
def test_cpu_flags_map_to_isas(monkeypatch, tmp_path, machine, flags, isas):
    """The flag line of a fake /proc/cpuinfo goes through _cpu_flags' parser into host_isas()."""
    info = tmp_path / "cpuinfo"
    info.write_text(fake_cpuinfo(machine, flags))
    real_open = open
    monkeypatch.setattr(
        cpu_kernels,
        "open",
        lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path, *a, **k),
        raising=False,
    )
    assert cpu_kernels._cpu_flags() == set(flags.split())
    monkeypatch.setattr(platform, "machine", lambda: machine)
    cpu_kernels._host_isas.cache_clear()
    assert cpu_kernels.host_isas() == isas
    # the same through a patched _cpu_flags
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: set(flags.split()))
    cpu_kernels._host_isas.cache_clear()
    assert cpu_kernels.host_isas() == isas
    assert cpu_kernels.selected_isa() == isas[0]


def test_avx_vnni_cpu_with_an_old_compiler_takes_the_avx2_build(monkeypatch):
    """No -mavxvnni in the compiler (GCC < 11): the AVX2 build, not the slow torch paths."""
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: set(ALDER_LAKE.split()))
    monkeypatch.setattr(cpu_kernels, "_compiler_accepts", lambda flags: "-mavxvnni" not in flags)
    cpu_kernels._host_isas.cache_clear()
    try:
        assert cpu_kernels.host_isas() == ["avx2", "portable"]
        assert cpu_kernels.selected_isa() == "avx2"
    finally:
        cpu_kernels._host_isas.cache_clear()


# ---------------------------------------------------------------- a build without OpenMP


@needs_cc
def test_build_without_openmp_gives_the_same_bits(monkeypatch, tmp_path):
    isa = HOST_ISAS[0]
    if cpu_kernels.library(isa) is None:
        pytest.skip("C kernels unavailable")
    rng = np.random.default_rng(0)
    n, k = 70, 256
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    x = torch.from_numpy(rng.standard_normal((11, k)).astype(np.float32))
    runs = [
        (pack_gguf_rows(BlockTensor(quantize(w, t), t, (n, k))), t)
        for t in (Q.Q4_0, Q.Q4_1, Q.Q8_0)
    ]
    want = [cpu_kernels.gguf_gemv(p, kind, n, x, isa=isa) for (p, kind), _ in runs]
    cc = cpu_kernels._compiler()
    normal = cpu_kernels.build(cc, isa)
    if cpu_kernels._openmp_flags(cc):
        assert b"GOMP_" in normal.read_bytes()  # the normal build uses OpenMP here

    monkeypatch.setattr(cpu_kernels, "_openmp_flags", lambda cc: ())
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    cpu_kernels._load.cache_clear()
    lib = cpu_kernels.library(isa)
    assert lib is not None and lib.gguf_gemv_isa().decode() == isa
    built = list(tmp_path.glob(f"kvserve-{isa}-*.so"))
    assert len(built) == 1 and b"GOMP_" not in built[0].read_bytes()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # asks for 2 threads: the single-threaded build ignores it
        got = [cpu_kernels.gguf_gemv(p, kind, n, x, isa=isa) for (p, kind), _ in runs]
    finally:
        torch.set_num_threads(before)
    for (_, t), a, b in zip(runs, got, want):
        assert torch.equal(a, b), t
