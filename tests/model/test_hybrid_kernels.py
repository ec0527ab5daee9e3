"""Gated DeltaNet kernels of hybrid targets: which implementation runs (logged once, recorded in
provenance), and the exact recurrent-state rollback with each implementation transformers dispatches to.

Stand-ins, registered the way transformers registers the real kernels (no CUDA here):

- the original packages: `fla` and `causal_conv1d` modules with the signatures of
  `flash-linear-attention` and `causal-conv1d`, each function wrapping the torch reference and
  counting its calls, put in `sys.modules` before a fresh import of transformers'
  `modeling_qwen3_5`: its own decorator (`use_kernel_func_from_hub_with_fallback`) resolves them
  exactly as it resolves the installed packages on a CUDA machine;
- a hub kernel: the `kernels` package's function-as-layer (`use_kernel_forward_from_hub` on a
  function makes an `nn.Module` singleton; `kernelize` binds the hub layer's `forward` on it).
  With `kernels` installed the real decorator builds it; without it (the lock has no `kernels`),
  `_kernels_singleton` builds the same object the same way.

The mutation: a kernel for the whole layer that runs its recurrence without the module globals
(what a hub kernel for `Qwen3_5GatedDeltaNet` would do) is refused, and with the refusal taken out
the same test sees the output drift from the target's greedy decoding.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import inspect
import logging
import sys
import types
from collections import Counter
from types import MethodType

import pytest
import torch
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY as _RECORDERS

from dflash_worker.errors import FamilyError
from dflash_worker.evaluate import greedy_generate, speculative_generate
from dflash_worker.evaluate.rollback import RECURRENCE_FUNCTIONS, RecurrentRollback
from dflash_worker.weights import linear_kernels

from .conftest import make_draft
from .test_speculate_hybrid import CORRUPT, NEW, OracleDraft, _hybrid, _inside_rejections, _prompts

MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"
KERNELS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")
STANDIN_VERSION = "0.0+stand-in"


@pytest.fixture
def fresh_record(monkeypatch):
    """`linear_kernels`' per-process memory emptied, as in a new process."""
    monkeypatch.setattr(linear_kernels, "_logged", set())
    monkeypatch.setattr(linear_kernels, "_loaded", [])


def _package(name: str, functions: dict) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__version__ = STANDIN_VERSION
    for fn_name, fn in functions.items():
        fn.__module__, fn.__qualname__ = name, fn_name
        setattr(module, fn_name, fn)
    return module


def _standin_packages(reference: types.ModuleType, calls: Counter) -> dict[str, types.ModuleType]:
    """`fla` and `causal_conv1d` with the real packages' argument names, computing with the torch references."""
    chunk, recurrent = (getattr(reference, n).__wrapped__ for n in RECURRENCE_FUNCTIONS)
    conv_fn, conv_update = reference.causal_conv1d_fn.__wrapped__, reference.causal_conv1d_update.__wrapped__

    # flash-linear-attention 0.6.0's argument names and order (`gk`, `gv` before `beta` in the recurrent one)
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                               state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, cp_context=None,
                               **kwargs):
        assert scale is None and cu_seqlens is None and not kwargs
        calls["chunk_gated_delta_rule"] += 1
        return chunk(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                         output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                         A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                                         state_v_first=False, cu_seqlens=None, **kwargs):
        assert scale is None and cu_seqlens is None and gk is None and gv is None and not kwargs
        calls["fused_recurrent_gated_delta_rule"] += 1
        return recurrent(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        assert seq_idx is None and initial_states is None and not return_final_states
        calls["causal_conv1d_fn"] += 1
        return conv_fn(x, weight, bias, activation)

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, conv_state_indices=None):
        calls["causal_conv1d_update"] += 1
        return conv_update(x, conv_state, weight, bias, activation)

    return {
        "fla": _package("fla", {"chunk_gated_delta_rule": chunk_gated_delta_rule,
                                "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule}),
        "causal_conv1d": _package("causal_conv1d", {"causal_conv1d_fn": causal_conv1d_fn,
                                                    "causal_conv1d_update": causal_conv1d_update}),
    }


@pytest.fixture(scope="module")
def reference_target():
    return _hybrid(False, 4)


@pytest.fixture(scope="module")
def standin_module(reference_target):
    """(modeling module imported with the stand-in packages, a target built from its classes with the
    reference target's weights, the stand-ins' call counts, the packages); transformers' own module is
    put back at once."""
    reference = importlib.import_module(MODELING)
    calls: Counter = Counter()
    packages = _standin_packages(reference, calls)
    with pytest.MonkeyPatch.context() as mp:
        for name, module in packages.items():
            mp.setitem(sys.modules, name, module)
        mp.setattr(sys.modules["transformers.models.qwen3_5"], "modeling_qwen3_5", reference)
        mp.delitem(sys.modules, MODELING)
        home = importlib.import_module(MODELING)  # the decorators run again and find `fla`, `causal_conv1d`
    assert home is not reference and sys.modules[MODELING] is reference
    saved = dict(_RECORDERS)
    torch.manual_seed(0)
    target = home.Qwen3_5ForCausalLM(reference_target.config).float().eval()
    target.load_state_dict(reference_target.state_dict())
    recorders = {k: v for k, v in _RECORDERS.items() if saved.get(k) is not v}
    dict.update(_RECORDERS, saved)
    return home, target, calls, packages, recorders


@pytest.fixture
def standin(standin_module, monkeypatch):
    """`standin_module`'s (module, target, calls), registered for one test as an import with the packages
    installed leaves them (the rollback and `linear_kernels` look modules up by name)."""
    home, target, calls, packages, recorders = standin_module
    monkeypatch.setitem(sys.modules, MODELING, home)
    for name, module in packages.items():
        monkeypatch.setitem(sys.modules, name, module)
    with _recorders(recorders):
        yield home, target, calls


@contextlib.contextmanager
def _recorders(entries: dict):
    """transformers keeps each model class's output recorders (`hidden_states` from which layer class)
    by class *name*: the stand-in module's classes share the names of transformers' own, so its
    entries are swapped in only while a test uses it."""
    saved = dict(_RECORDERS)
    dict.update(_RECORDERS, entries)
    try:
        yield
    finally:
        dict.clear(_RECORDERS)
        dict.update(_RECORDERS, saved)


def test_reference_kernels_are_logged_once_and_recorded_in_provenance(tmp_path, caplog, fresh_record):
    from dflash_worker.device import provenance
    from dflash_worker.testing.tiny import tiny_qwen3_5_config
    from dflash_worker.weights.loader import build_meta_model

    assert "linear_attention_kernels" not in provenance()  # no hybrid target built in this "process" yet
    tiny_qwen3_5_config().save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="dflash_worker.kernels"):
        build_meta_model(tmp_path, None)
        model = build_meta_model(tmp_path, None)
    linear_kernels.check_device(model, "cpu")  # the references run anywhere
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash_worker.kernels"]
    expected = dict.fromkeys(KERNELS, linear_kernels.REFERENCE)
    assert lines == [linear_kernels.format_line("qwen3_5", expected)], lines
    assert lines[0] == ("linear-attention kernels (qwen3_5): chunk_gated_delta_rule=torch reference, "
                        "fused_recurrent_gated_delta_rule=torch reference, causal_conv1d_fn=torch reference, "
                        "causal_conv1d_update=torch reference")
    assert provenance()["linear_attention_kernels"] == {"qwen3_5": expected}


def test_targets_without_linear_attention_log_and_record_nothing(tmp_path, caplog, fresh_record):
    from dflash_worker.device import provenance
    from dflash_worker.testing.tiny import tiny_qwen3_config
    from dflash_worker.weights.loader import build_meta_model

    tiny_qwen3_config().save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="dflash_worker.kernels"):
        assert linear_kernels.target_kernels(build_meta_model(tmp_path, None)) is None
    assert not [r for r in caplog.records if r.name == "dflash_worker.kernels"]
    assert "linear_attention_kernels" not in provenance()


def test_standin_packages_are_what_the_log_line_and_provenance_name(standin, caplog, fresh_record):
    from dflash_worker.device import provenance

    home, target, _ = standin
    with caplog.at_level(logging.INFO, logger="dflash_worker.kernels"):
        found = linear_kernels.log_target_kernels(target)
    expected = {
        "chunk_gated_delta_rule": f"flash-linear-attention {STANDIN_VERSION} (fla.chunk_gated_delta_rule)",
        "fused_recurrent_gated_delta_rule": f"flash-linear-attention {STANDIN_VERSION} (fla.fused_recurrent_gated_delta_rule)",
        "causal_conv1d_fn": f"causal-conv1d {STANDIN_VERSION} (causal_conv1d.causal_conv1d_fn)",
        "causal_conv1d_update": f"causal-conv1d {STANDIN_VERSION} (causal_conv1d.causal_conv1d_update)",
    }
    assert found == {"qwen3_5": expected}
    assert [r.getMessage() for r in caplog.records] == [linear_kernels.format_line("qwen3_5", expected)]
    assert provenance()["linear_attention_kernels"] == {"qwen3_5": expected}


def _oracle(reference_target, ref_ids: torch.Tensor) -> OracleDraft:
    real = make_draft(reference_target.config, v2=False, seed=5, block_size=16)[0]
    return OracleDraft(real, ref_ids, CORRUPT)


@pytest.fixture(scope="module")
def standin_greedy(standin_module, reference_target):
    """The stand-in target's greedy decoding of each prompt, equal to the reference target's."""
    _, target, calls, _, recorders = standin_module
    with _recorders(recorders):
        out = [greedy_generate(target, p, max_new_tokens=NEW) for p in _prompts()]
    assert all(torch.equal(o, greedy_generate(reference_target, p, max_new_tokens=NEW)) for o, p in zip(out, _prompts()))
    assert calls["fused_recurrent_gated_delta_rule"] and calls["causal_conv1d_update"]  # 1-token decoding ran on them
    return out


@pytest.mark.parametrize("block", [8, 16])
def test_rollback_with_standin_packages_keeps_the_greedy_output(standin, standin_greedy, reference_target, block):
    _, target, calls = standin
    lengths, inside = [], []
    for prompt, ref in zip(_prompts(), standin_greedy):
        calls.clear()
        res = speculative_generate(_oracle(reference_target, ref), target, prompt, max_new_tokens=NEW, block_size=block)
        assert torch.equal(res.output_ids, ref), (res.acceptance_lengths, res.output_ids, ref)
        # the verify forwards ran the stand-in chunked rule and conv; the replays its recurrent rule
        assert calls["chunk_gated_delta_rule"] and calls["causal_conv1d_fn"] and calls["fused_recurrent_gated_delta_rule"]
        lengths += res.acceptance_lengths
        inside += _inside_rejections(res.acceptance_lengths, block)
    assert inside, lengths  # rejections inside blocks happened: the replay did work


def _bypassing_layer_kernel(home: types.ModuleType, layer: torch.nn.Module):
    """A kernel for the whole Gated DeltaNet layer, as `kernelize` would bind a hub layer's forward on
    `layer`: the same computation, its recurrence calling the stand-in package functions as resolved
    at import, not through the module globals the rollback wraps."""
    resolved = {n: getattr(home, n) for n in RECURRENCE_FUNCTIONS}  # before any `recording()`
    original = type(layer).forward

    def forward(self, *args, **kwargs):
        wrapped = {n: getattr(home, n) for n in RECURRENCE_FUNCTIONS}
        for n, fn in resolved.items():
            setattr(home, n, fn)
        try:
            return original(self, *args, **kwargs)
        finally:
            for n, fn in wrapped.items():
                setattr(home, n, fn)

    return MethodType(forward, layer)


def test_a_layer_kernel_bypassing_the_interception_is_refused_and_would_drift(standin, standin_greedy, reference_target,
                                                                              monkeypatch):
    """Mutation: the recurrence runs outside the wrapped globals. The rollback refuses (`FamilyError`);
    with that refusal removed, the same run is no longer the target's greedy decoding."""
    home, target, calls = standin
    before = {n: getattr(home, n) for n in RECURRENCE_FUNCTIONS}
    for idx in (0, 1, 2):
        layer = target.model.layers[idx].linear_attn
        monkeypatch.setattr(layer, "forward", _bypassing_layer_kernel(home, layer))
    prompt, ref = _prompts()[0], standin_greedy[0]
    calls.clear()
    with pytest.raises(FamilyError, match=r"layer `0`.*ran its forward without calling.*\n.*hint:"):
        speculative_generate(_oracle(reference_target, ref), target, prompt, max_new_tokens=NEW, block_size=8)
    assert calls["chunk_gated_delta_rule"]  # the bypass did run the stand-in kernel
    assert {n: getattr(home, n) for n in RECURRENCE_FUNCTIONS} == before  # restored in `finally`

    def no_refusal(self, idx):
        return lambda module, args, output: setattr(self, "_running", None)

    monkeypatch.setattr(RecurrentRollback, "_leave_hook", no_refusal)
    differ = False
    for prompt, ref in zip(_prompts(), standin_greedy):
        res = speculative_generate(_oracle(reference_target, ref), target, prompt, max_new_tokens=NEW, block_size=8)
        differ |= not torch.equal(res.output_ids, ref)
    assert differ, "a kernel bypassing the interception went unnoticed and did not change the output"


def _kernels_singleton(func, hub_forward):
    """`func` as the `kernels` package exposes a decorated function (an `nn.Module` singleton named
    after it), with `hub_forward` (unless None) bound as `kernelize` binds a hub layer's forward."""
    try:
        from kernels import use_kernel_forward_from_hub
    except ImportError:  # the same object, built as kernels' `_create_func_module` builds it
        def use_kernel_forward_from_hub(name):
            def decorate(func):
                class Func(torch.nn.Module):
                    kernel_layer_name = name

                    def forward(self, *args, **kwargs):
                        return func(*args, **kwargs)

                params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *inspect.signature(func).parameters.values()]
                Func.forward.__signature__ = inspect.Signature(params)
                return Func()

            return decorate

    singleton = use_kernel_forward_from_hub(func.__name__)(func)
    if hub_forward is not None:
        singleton.forward = MethodType(hub_forward, singleton)
    return singleton


def test_rollback_with_hub_kernel_singletons_keeps_the_greedy_output(reference_target, monkeypatch, fresh_record):
    """transformers with the `kernels` package makes each recurrence global an `nn.Module` singleton,
    whose call signature is `(*args, **kwargs)`: the rollback binds calls against the decorated
    function's, and the replay runs the hub kernel."""
    home = importlib.import_module(MODELING)
    calls: Counter = Counter()
    for name in RECURRENCE_FUNCTIONS:
        decorated, reference = getattr(home, name), getattr(home, name).__wrapped__

        def hub_forward(self, query, key, value, g, beta, *args, _ref=reference, _name=name, **kwargs):
            calls[_name] += 1
            return _ref(query, key, value, g, beta, *args, **kwargs)

        monkeypatch.setattr(home, name, _kernels_singleton(decorated, hub_forward))
    from dflash_worker.device import provenance

    described = linear_kernels.log_target_kernels(reference_target)["qwen3_5"]
    assert described["chunk_gated_delta_rule"].startswith("hub kernel ") and "hub_forward" in described["chunk_gated_delta_rule"]
    assert described["causal_conv1d_fn"] == linear_kernels.REFERENCE
    assert provenance()["linear_attention_kernels"] == {"qwen3_5": described}
    # not kernelized: the singleton runs the function it wraps, here transformers' reference
    assert linear_kernels.describe(_kernels_singleton(home.causal_conv1d_fn, None)) == linear_kernels.REFERENCE
    for prompt in _prompts(2):
        ref = greedy_generate(reference_target, prompt, max_new_tokens=NEW)
        calls.clear()
        res = speculative_generate(_oracle(reference_target, ref), reference_target, prompt, max_new_tokens=NEW, block_size=8)
        assert torch.equal(res.output_ids, ref), res.acceptance_lengths
        assert _inside_rejections(res.acceptance_lengths, 8) and set(calls) == set(RECURRENCE_FUNCTIONS), calls


def test_packaged_kernels_are_refused_off_cuda_before_loading(standin):
    """transformers would hand CPU / MPS tensors to an importable `fla` (Triton: GPU tensors only);
    `load_model` refuses first, naming the packages (the references pass on any device: the test above)."""
    from dflash_worker.errors import DeviceError

    _, target, _ = standin
    for device in ("cpu", "mps"):
        with pytest.raises(DeviceError, match=rf"on `{device}`.*to `causal-conv1d 0\.0\+stand-in`, `flash-linear-attention 0\.0\+stand-in`, .*CUDA only\n.*hint:"):
            linear_kernels.check_device(target, device)
    linear_kernels.check_device(target, "cuda:0")


def test_the_cli_prints_the_line_once_on_stderr_and_leaves_logging_as_it_was(tmp_path, capsys, fresh_record):
    from dflash_worker.cli import main
    from dflash_worker.testing.tiny import save_tiny_target

    save_tiny_target(tmp_path / "target", family="qwen3_5_moe")
    root = logging.getLogger("dflash_worker")
    before = (list(root.handlers), root.level)
    assert main(["inspect-checkpoint", str(tmp_path / "target")]) == 0
    err = capsys.readouterr().err
    expected = linear_kernels.format_line("qwen3_5_moe", dict.fromkeys(KERNELS, linear_kernels.REFERENCE))
    assert [line for line in err.splitlines() if "linear-attention kernels" in line] == [f"dflash-worker: {expected}"], err
    assert (list(root.handlers), root.level) == before
