"""flm.kernels.launch.DirectLaunch: the compiled kernel is reused only for arguments Triton would compile alike, and
launched with the arguments in the kernel's signature order. No GPU: a stand-in for the JITFunction and its compiled
kernel; tests/attention/test_triton_jvp_gpu.py checks the real launches."""

import types

import pytest
import torch

from flm.kernels import launch


class _Compiled:
    def __init__(self, log):
        self.function, self.packed_metadata, self.log = "function", "metadata", log

    def run(self, g0, g1, g2, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
        self.log.append(("direct", (g0, g1, g2), args))


class _JIT:
    """Records ordinary launches; its signature: two runtime arguments, then BLOCK and FLAG."""

    def __init__(self):
        self.arg_names = ["X", "n", "BLOCK", "FLAG"]
        self.log = []

    def __getitem__(self, grid):
        def run(*args, num_warps, num_stages, **constexprs):
            self.log.append(("jit", grid, args, constexprs))
            return _Compiled(self.log)

        return run


@pytest.fixture
def jit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    driver = types.SimpleNamespace(get_current_stream=lambda device: 7)
    monkeypatch.setattr(launch.triton.runtime, "driver", types.SimpleNamespace(active=driver))
    if launch.knobs is None:
        pytest.skip("this Triton has no knobs: every launch takes the ordinary path")
    return _JIT()  # Triton's own hooks: empty chains


def test_the_second_launch_is_direct_with_the_signature_order(jit):
    run = launch.DirectLaunch(jit)
    x = torch.zeros(64)
    for _ in range(3):
        run((4, 2), [x, 32], {"FLAG": True, "BLOCK": 16}, 4, 2)  # constexprs in another order than the signature
    assert [e[0] for e in jit.log] == ["jit", "direct", "direct"]
    assert jit.log[1] == ("direct", (4, 2, 1), (x, 32, 16, True))


@pytest.mark.parametrize(
    "other",
    [
        lambda x: ([x[1:], 32], {"BLOCK": 16, "FLAG": True}, 4),  # a pointer off 16-byte alignment
        lambda x: ([x.half(), 32], {"BLOCK": 16, "FLAG": True}, 4),  # another dtype
        lambda x: ([x, 1], {"BLOCK": 16, "FLAG": True}, 4),  # an int that is 1
        lambda x: ([x, 33], {"BLOCK": 16, "FLAG": True}, 4),  # an int not a multiple of 16
        lambda x: ([x, 2**31], {"BLOCK": 16, "FLAG": True}, 4),  # a 64-bit int
        lambda x: ([x, 32], {"BLOCK": 32, "FLAG": True}, 4),  # another constexpr
        lambda x: ([x, 2**63], {"BLOCK": 16, "FLAG": True}, 4),  # an unsigned 64-bit int
        lambda x: ([x, 32], {"BLOCK": 16, "FLAG": True}, 8),  # other warps
    ],
)
def test_arguments_triton_compiles_differently_take_the_ordinary_path(jit, other):
    run = launch.DirectLaunch(jit)
    x = torch.zeros(64)
    run((1,), [x, 32], {"BLOCK": 16, "FLAG": True}, 4, 2)
    args, constexprs, warps = other(x)
    run((1,), args, constexprs, warps, 2)
    assert [e[0] for e in jit.log] == ["jit", "jit"]
    run((1,), [x, 48], {"BLOCK": 16, "FLAG": True}, 4, 2)  # the first one's specialisation again: direct
    assert jit.log[-1][0] == "direct"


def test_a_launch_hook_takes_the_ordinary_path(jit, monkeypatch):
    run = launch.DirectLaunch(jit)
    x = torch.zeros(64)
    run((1,), [x, 32], {"BLOCK": 16, "FLAG": True}, 4, 2)
    chain = type(launch.knobs.runtime.launch_enter_hook)()
    chain.add(lambda metadata: None)  # a profiler's
    monkeypatch.setattr(launch.knobs.runtime, "launch_enter_hook", chain)
    run((1,), [x, 32], {"BLOCK": 16, "FLAG": True}, 4, 2)
    assert [e[0] for e in jit.log] == ["jit", "jit"]


def test_constexprs_are_keyed_by_name_not_position(jit):
    run = launch.DirectLaunch(jit)
    x = torch.zeros(64)
    run((1,), [x, 32], {"BLOCK": 16, "FLAG": 32}, 4, 2)
    run((1,), [x, 32], {"FLAG": 16, "BLOCK": 32}, 4, 2)  # the same values under the other names
    assert [e[0] for e in jit.log] == ["jit", "jit"]


def test_a_launcher_that_refuses_the_arguments_turns_direct_launches_off(jit):
    def refuses(*args):
        raise TypeError("function takes exactly 12 arguments")

    run = launch.DirectLaunch(jit)
    x = torch.zeros(64)
    run((1,), [x, 32], {"BLOCK": 16, "FLAG": True}, 4, 2)
    next(iter(run.compiled.values()))[0].run = refuses
    with pytest.warns(UserWarning, match="launching .* directly failed .*takes exactly 12 arguments"):
        run((1,), [x, 32], {"BLOCK": 16, "FLAG": True}, 4, 2)
    run((1,), [x, 32], {"BLOCK": 16, "FLAG": True}, 4, 2)
    assert [e[0] for e in jit.log] == ["jit", "jit", "jit"] and run.compiled == {}


def test_untuned_keys_take_the_first_candidate_that_fits_and_tuned_ones_the_fastest(monkeypatch):
    """FLM_ATTENTION_AUTOTUNE=0: the first config whose launch compiles within the GPU's resources, skipping the ones
    the autotuner would skip; when none fits, the last one's error. Tuned: the fastest of those that fit."""
    from triton.runtime.errors import OutOfResources

    from flm.kernels import attention_fwd as kernels

    tried = []

    def launch(config):
        tried.append(config)
        if config[0] > 64:
            raise OutOfResources(240_000, 232_448, "shared memory")

    assert kernels.first_that_fits(launch, [(128, 64, 8, 4), (64, 64, 4, 3), (64, 32, 4, 2)]) == (64, 64, 4, 3)
    assert tried == [(128, 64, 8, 4), (64, 64, 4, 3)]
    with pytest.raises(OutOfResources):
        kernels.first_that_fits(launch, [(128, 64, 8, 4), (128, 32, 8, 4)])
    with pytest.raises(ZeroDivisionError):  # any other error is the caller's
        kernels.first_that_fits(lambda c: 1 / 0, [(64, 64, 4, 3), (64, 32, 4, 2)])

    timings = {(128, 64, 8, 4): 0.5, (64, 64, 4, 3): 2.0, (64, 32, 4, 2): 1.0}  # the first would win, but does not fit
    tried.clear()
    assert kernels.fastest(launch, list(timings), bench=lambda run: timings[run.args[0]]) == (64, 32, 4, 2)
    assert tried == list(timings)  # each compiled once (the stand-in bench does not launch)
    with pytest.raises(OutOfResources):
        kernels.fastest(launch, [(128, 64, 8, 4), (128, 32, 8, 4)], bench=lambda run: 1.0)

    # by default each candidate's GPU time comes from replays of a CUDA graph, after a synchronize: the timing runs on a
    # stream of its own, and do_bench's per-call events counted the host's launch where it outlasted the cache flush
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))

    def replays(fn, rep, return_mode):
        calls.append(("graph", return_mode))
        fn()
        return timings[tried[-1]]

    monkeypatch.setattr(kernels.triton.testing, "do_bench_cudagraph", replays)
    tried.clear()
    assert kernels.fastest(launch, list(timings)) == (64, 32, 4, 2)
    assert calls == ["synchronize", ("graph", "median")] * 2

    # in the order of the load kinds: host-built descriptors their own list where the width has one, else the pointers'
    both = kernels.launch_candidates(72 + 8, False, (0, 2))
    assert both == [*((*c, 0) for c in kernels._CANDIDATES[80]), *((*c, 2) for c in kernels._HOST_TMA_CANDIDATES[80])]
    assert kernels.launch_candidates(96, False, (2, 1)) == [(*c, tma) for tma in (2, 1) for c in kernels._CANDIDATES[96]]
    assert kernels.candidates(80, False) == kernels._CANDIDATES[80]
    assert kernels.candidates(72 + 8, True) == [*kernels._CANDIDATES[80], kernels._BIAS_FALLBACK]
    assert kernels.candidates(192, False) == kernels._CANDIDATES[256]
    for off in ("0", "off", "False"):
        monkeypatch.setenv("FLM_ATTENTION_AUTOTUNE", off)
        assert not kernels.autotuning()
    monkeypatch.setenv("FLM_ATTENTION_AUTOTUNE", "1")
    assert kernels.autotuning()
    monkeypatch.delenv("FLM_ATTENTION_AUTOTUNE")
    assert kernels.autotuning()
    monkeypatch.setenv("FLM_ATTENTION_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="FLM_ATTENTION_AUTOTUNE='sometimes': set 1"):
        kernels.autotuning()


def test_tensor_descriptors_are_keyed_by_dtype_and_block_shape():
    """A host-built descriptor (FLM_ATTENTION_TMA=host) compiles per dtype and block shape, not per tensor or layout."""
    if launch.TensorDescriptor is None:
        pytest.skip("this Triton has no host-built tensor descriptors")
    make = lambda x, block: launch.TensorDescriptor(x, list(x.shape), list(x.stride()), block)  # noqa: E731
    x, y = torch.zeros(2, 3, 64, 32), torch.zeros(2, 64, 3, 32).transpose(1, 2)
    key = launch.specialization([make(x, [1, 1, 16, 32])])
    assert launch.specialization([make(y, [1, 1, 16, 32])]) == key
    assert launch.specialization([make(x, [1, 1, 32, 32])]) != key
    assert launch.specialization([make(x.half(), [1, 1, 16, 32])]) != key


def test_a_new_shape_inside_a_cuda_graph_capture_is_not_timed_nor_kept(monkeypatch):
    """Timing synchronises, which a capture forbids: a shape first seen inside one launches its first candidate that
    fits, untimed, and keeps no choice, so the next eager call tunes it. Outside a capture the tuner times and keeps."""
    from flm.kernels import attention_fwd as kernels

    launched, timed = [], []
    monkeypatch.setattr(kernels, "interpreted", lambda: False)
    monkeypatch.setattr(kernels, "_fwd_launch", lambda grid, args, meta, warps, stages: launched.append(meta["BLOCK_M"]))
    monkeypatch.setattr(kernels, "fastest", lambda launch, configs: timed.append(configs) or configs[-1])
    monkeypatch.setattr(kernels, "_TUNED", {})
    monkeypatch.setenv("FLM_ATTENTION_AUTOTUNE", "1")
    q, k, v = (torch.zeros(1, 2, 40, 64) for _ in range(3))
    monkeypatch.setattr(kernels, "_capturing", lambda x: True)
    kernels.attention_fwd(q, k, v, causal=False, scale=0.125)
    assert launched == [kernels.candidates(64, False)[0][0]] and timed == [] and kernels._TUNED == {}
    monkeypatch.setattr(kernels, "_capturing", lambda x: False)
    kernels.attention_fwd(q, k, v, causal=False, scale=0.125)
    assert len(timed) == 1 and list(kernels._TUNED.values()) == [timed[0][-1]]


def test_last_choice_names_the_latest_tuned_config(monkeypatch):
    """What the benchmarks print as the tuned forward: the config tuned last, its load kind by name."""
    from flm.kernels import attention_fwd as kernels

    monkeypatch.setattr(kernels, "_TUNED", {"a": (128, 64, 8, 2, 0), "b": (64, 64, 4, 3, 2)})
    assert kernels.last_choice() == "64x64x4x3 tma-host"
    kernels._TUNED["c"] = (128, 128, 8, 3, 0)
    assert kernels.last_choice() == "128x128x8x3 pointers"
