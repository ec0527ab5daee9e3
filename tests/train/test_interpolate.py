"""Interpolated exports (`[train].interpolate = "auto"`, `train.interpolate`): when the general-domain
guard rejects every checkpoint, the weights between the released draft and the best own-domain
checkpoint can still keep part of its own gain inside the tolerance.

The search on plain validation entries (no model), then the guard world (`guard_world`): a run whose
every checkpoint forgot more than the tolerance exports an interpolated point with a positive own gain,
the same run with interpolation off exports the released draft, and the interpolated export is
byte-reproducible (a resumed run, a second export).
"""

from __future__ import annotations

import json

import pytest
import torch
from guard_world import TOLERANCE, GuardWorld

from dflash_worker.errors import ConfigError, ResumeError
from dflash_worker.manifest import sha256_file
from dflash_worker.recipe import load_recipe, recipe_from_dict
from dflash_worker.train import StopFlags, selection, train
from dflash_worker.train import checkpoint as ckpt
from dflash_worker.train import interpolate as interp

# ------------------------------------------------------------------ the search on plain entries

RELEASED = {"step": 0, "examples": 4, "matching_proposals": 2.0, "blocks": 8, "ce": 0.5, "selector_ce": None,
            "reached": 1, "covered": 1, "selected": 1, "own": {"matching_proposals": 0.5, "blocks": 8}}


def _entry(own: float, general: float, modes: dict[str, float] | None = None) -> dict:
    e = {"step": 8, "matching_proposals": own, "blocks": 8, "general": {"matching_proposals": general, "blocks": 8}}
    if modes is not None:
        e["modes"] = {m: {"matching_proposals": v, "blocks": 4} for m, v in modes.items()}
    return e


def _line(alpha: float) -> dict:
    """A straight trade: own rises 0.5 -> 2.5 and general falls 2.0 -> 1.0 along alpha (floor 1.8 at alpha 0.2)."""
    return _entry(0.5 + 2.0 * alpha, 2.0 - alpha)


def test_bisection_keeps_the_best_point_inside_the_tolerance():
    tried = []

    def measure(alpha: float) -> dict:
        tried.append(alpha)
        return _line(alpha)

    found = interp.search(measure, _line(1.0), RELEASED, selection.released_entry(RELEASED), tolerance=0.1)
    # 0.5 and 0.25 fall below the floor 1.8, 0.125 and 0.1875 keep it, 0.21875 and 0.203125 do not
    assert tried == [0.5, 0.25, 0.125, 0.1875, 0.21875, 0.203125] and found["passes"] == interp.PASSES == 6
    assert found["alpha"] == 0.1875 and found["checkpoint_step"] == 8
    assert found["validation"]["matching_proposals"] == 0.5 + 2.0 * 0.1875 and found["validation"]["alpha"] == 0.1875
    points = found["points"]
    assert [p["alpha"] for p in points] == sorted([0.0, 1.0, *tried])
    assert [p["alpha"] for p in points if not p["rejected"]] == [0.0, 0.125, 0.1875]
    assert points[0]["matching_proposals"] == 0.5 and points[0]["general_matching_proposals"] == 2.0  # the released draft
    assert (found["released_matching_proposals"], found["checkpoint_matching_proposals"]) == (0.5, 2.5)


def test_no_kept_point_or_none_better_than_the_guarded_selection_keeps_the_selection():
    steep = interp.search(lambda a: _entry(0.5 + a, 1.5), _entry(1.5, 1.5), RELEASED, selection.released_entry(RELEASED),
                          tolerance=0.1)
    assert steep["alpha"] is None and steep["validation"] is None
    assert [p["alpha"] for p in steep["points"]] == [0.0, 1 / 64, 1 / 32, 1 / 16, 0.125, 0.25, 0.5, 1.0]
    assert all(p["rejected"] for p in steep["points"][1:])
    # a kept checkpoint (own 1.0) beats every point the guard keeps (own at most 0.875)
    kept = interp.search(_line, _line(1.0), RELEASED, _entry(1.0, 1.9), tolerance=0.1)
    assert kept["alpha"] is None and kept["guarded_selection_matching_proposals"] == 1.0


def test_each_thinking_mode_the_released_draft_served_bounds_the_search():
    released = {**RELEASED, "modes": {"on": {"matching_proposals": 1.0, "blocks": 4}, "off": {"matching_proposals": 2.0, "blocks": 4}}}
    # general holds everywhere, but mode `on` falls below its floor 0.9 past alpha 0.1
    found = interp.search(lambda a: _entry(0.5 + a, 2.0, {"on": 1.0 - a, "off": 2.0}), _entry(1.5, 2.0, {"on": 0.0, "off": 2.0}),
                          released, selection.released_entry(released), tolerance=0.1)
    assert found["alpha"] == 0.09375
    assert {p["alpha"]: p["modes_below"] for p in found["points"]}[0.125] == ["on"]


def test_lerp_is_exact_at_its_ends_and_float32_between():
    r, c = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.equal(interp.lerp({"w": r}, {"w": c}, 0.0)["w"], r) and torch.equal(interp.lerp({"w": r}, {"w": c}, 1.0)["w"], c)
    mid = interp.lerp({"w": r.double()}, {"w": c.bfloat16()}, 0.25)["w"]
    assert mid.dtype == torch.float32 and torch.equal(mid, r.float() * 0.75 + c.bfloat16().float() * 0.25)


def test_the_recipe_key_the_preset_and_old_checkpoints(tmp_path):
    from dflash_worker.train.resume import compare_for_resume

    base = {"model": {"target": "t", "draft": "d", "family": "qwen3"}, "data": {"dir": "x", "thinking": "off"}}
    assert recipe_from_dict({**base, "train": {"scope": "full"}}, base=tmp_path).require("train").interpolate == "off"
    assert recipe_from_dict({**base, "train": {"preset": "keep_general"}}, base=tmp_path).require("train").interpolate == "auto"
    assert recipe_from_dict({**base, "train": {"preset": "keep_general", "interpolate": "off"}}, base=tmp_path).require("train").interpolate == "off"
    with pytest.raises(ConfigError, match=r"`\[train\].interpolate` is `on`\nhint: choose one of `off`, `auto`"):
        recipe_from_dict({**base, "train": {"scope": "full", "interpolate": "on"}}, base=tmp_path)
    # a checkpoint written before the key (a `keep_general` run, now "auto") resumes with either value;
    # one that records it must agree
    old = {"recipe_view": {"train.preset": "keep_general"}, "data_fingerprint": "d", "draft_fingerprint": {}}
    for value in ("off", "auto"):
        compare_for_resume(old, {**old, "recipe_view": {"train.preset": "keep_general", "train.interpolate": value}})
    new = {**old, "recipe_view": {"train.preset": "keep_general", "train.interpolate": "auto"}}
    with pytest.raises(ResumeError, match="recipe `train.interpolate`: checkpoint `auto`, now `off`"):
        compare_for_resume(new, {**old, "recipe_view": {"train.preset": "keep_general", "train.interpolate": "off"}})


def test_the_outcome_line_says_what_the_export_is():
    guard = selection.guard_report([_line(1.0)], RELEASED, tolerance=0.1, patience=0, stopped_at=None)
    found = interp.search(_line, _line(1.0), RELEASED, selection.released_entry(RELEASED), tolerance=0.1)
    point = found.pop("validation")
    record = selection.record(point, guard, [_line(1.0)], step=8, checkpoint="step-00000008", checkpoint_manifest_sha256="m",
                              total_steps=8, interpolation=found)
    line = selection.outcome(record)
    assert line == ("interpolated export: alpha 0.1875 from the released draft toward step 8; own-domain validation matching "
                    "proposals 0.8750 (released 0.5000, step 8 2.5000: the interpolation cost 1.6250, 19% of its gain), general "
                    "1.8125 within 10% of the released draft's 2.0000")
    released = selection.record(selection.released_entry(RELEASED), guard, [_line(1.0)], step=0, checkpoint="step-00000000",
                                checkpoint_manifest_sha256="m", total_steps=8, interpolation={**found, "alpha": None})
    assert selection.outcome(released).startswith("the export is the released draft (it adapts nothing): no checkpoint and no "
                                                  "interpolation (6 points tried) kept general-domain")
    assert selection.outcome({k: v for k, v in released.items() if k != "interpolation"}).startswith(
        "the export is the released draft (it adapts nothing): no checkpoint kept general-domain")
    from dflash_worker.evaluate.report import selection_facts

    assert selection_facts(record) == {"selection_step": 8, "interpolation_alpha": 0.1875, "selection_note": line}
    assert selection_facts(released)["selection_note"] == selection.outcome(released)


# ------------------------------------------------------------------ the guard world

# Every validation (steps 4, 8, 12) forgets more than the tolerance: measured, general matching
# proposals 0.97 / 0.63 / 0.60 against the released draft's 1.20 (floor 1.08).
RUN = dict(general_tolerance=TOLERANCE, steps=12, lr=3e-3, warmup_steps=4, val_every=4, checkpoint_every=4)


def _selection(run) -> dict:
    return json.loads((run / "selection.json").read_text())


@pytest.fixture(scope="module")
def runs(guard_world: GuardWorld) -> dict:
    w = guard_world
    events: list = []
    out = {"auto": train(load_recipe(w.recipe("interp-auto", interpolate="auto", **RUN)), on_event=events.append),
           "off": train(load_recipe(w.recipe("interp-off", **RUN)))}
    return {**out, "events": events}


def test_every_checkpoint_forgot_and_the_interpolated_export_keeps_an_own_gain_inside_the_tolerance(guard_world, runs):
    from safetensors.torch import load_file

    a, o = _selection(guard_world.root / "interp-auto"), _selection(guard_world.root / "interp-off")
    guard = a["guard"]
    assert a["history"] == o["history"] and a["guard"] == o["guard"]  # the same training: only the selection differs
    assert [c["step"] for c in guard["checkpoints"]] == [4, 8, 12] and guard["rejected_steps"] == [4, 8, 12]
    assert not guard["passed"]

    # interpolation off: today's behaviour, the released draft itself, and one line says why
    assert o["step"] == 0 and "interpolation" not in o
    assert "selected step 0" in runs["off"].message and "no checkpoint passed the general-domain guard" in runs["off"].message
    ours = load_file(str(runs["off"].export_dir / "model.safetensors"))
    theirs = load_file(str(guard_world.root / "release" / "export" / "model.safetensors"))
    assert all(torch.equal(ours[n].view(torch.uint8), t.view(torch.uint8)) for n, t in theirs.items())

    # interpolation on: a point between the released draft and the best own checkpoint
    i = a["interpolation"]
    top = max((h for h in a["history"]), key=lambda h: (h["matching_proposals"], -h["step"]))
    assert i["checkpoint_step"] == top["step"] == a["step"] and a["checkpoint"] == ckpt.step_name(top["step"])
    assert 0 < i["alpha"] < 1 and len(i["points"]) == 2 + interp.PASSES
    v = a["validation"]
    released_own = i["released_matching_proposals"]
    assert v["alpha"] == i["alpha"] and v["step"] == top["step"]
    assert v["general"]["matching_proposals"] >= guard["floor"]  # inside the tolerance
    assert v["matching_proposals"] > released_own == o["validation"]["matching_proposals"]  # a positive own-domain gain
    assert v["matching_proposals"] <= top["matching_proposals"]
    chosen = next(p for p in i["points"] if p["alpha"] == i["alpha"])
    assert not chosen["rejected"] and chosen["matching_proposals"] == v["matching_proposals"]
    print(f"alpha {i['alpha']}: own {released_own:.4f} -> {v['matching_proposals']:.4f} (step {top['step']}: "
          f"{top['matching_proposals']:.4f}); general {guard['released_general_matching_proposals']:.4f} -> "
          f"{v['general']['matching_proposals']:.4f} (floor {guard['floor']:.4f}; step {top['step']}: "
          f"{top['general_matching_proposals']:.4f})")

    # it says so, in one line, with alpha and what it cost the own domain
    note = selection.outcome(a)
    assert note is not None and note.startswith(f"interpolated export: alpha {i['alpha']:g} from the released draft toward step")
    assert [e.message for e in runs["events"] if getattr(e, "message", "").startswith("interpolated export")] == [note]
    assert runs["auto"].message.endswith("; the general-domain guard rejected steps: 4, 8, 12")
    assert f"selected step {top['step']} at alpha {i['alpha']:g}" in runs["auto"].message

    # the export holds theta(alpha) of the trained tensors (BF16), the released draft's values elsewhere
    run = guard_world.root / "interp-auto"
    released = ckpt.load(run / ckpt.CHECKPOINTS / ckpt.step_name(0)).trainable
    trained = ckpt.load(run / ckpt.CHECKPOINTS / a["checkpoint"]).trainable
    exported = load_file(str(runs["auto"].export_dir / "model.safetensors"))
    for name, value in interp.lerp(released, trained, i["alpha"]).items():
        assert torch.equal(exported[name], value.to(torch.bfloat16)), name
    assert set(exported) == set(theirs)
    manifest = json.loads((runs["auto"].export_dir / "manifest.json").read_text())
    assert manifest["provenance"]["checkpoint"]["interpolation_alpha"] == i["alpha"]


def test_an_interpolated_export_is_byte_reproducible_and_resumes_exactly(guard_world, runs, tmp_path):
    from dflash_worker.train.export_run import export_run

    w, ref = guard_world, runs["auto"]
    flags = StopFlags()
    flags.request_stop("test")
    assert train(load_recipe(w.recipe("interp-res", interpolate="auto", **RUN)), flags=flags).status == "stopped"
    done = train(load_recipe(w.recipe("interp-res", interpolate="auto", **RUN)), resume=True)
    assert done.status == "completed"
    a, b = _selection(w.root / "interp-auto"), _selection(w.root / "interp-res")
    assert a["interpolation"] == b["interpolation"] and a["validation"] == b["validation"]
    assert sha256_file(ref.export_dir / "model.safetensors") == sha256_file(done.export_dir / "model.safetensors")
    # exported again from selection.json: the same bytes
    again = export_run(w.root / "interp-auto", fmt="bf16", recipe=load_recipe(w.root / "interp-auto.toml"), out_dir=tmp_path / "again")
    assert sha256_file(again.out_dir / "model.safetensors") == sha256_file(ref.export_dir / "model.safetensors")
    # a completed run verifies instead of searching again
    assert train(load_recipe(w.recipe("interp-res", interpolate="auto", **RUN)), resume=True).status == "verified"


def test_interpolation_needs_general_val_rows(guard_world):
    from dflash_worker.train.loop import Trainer

    w = guard_world
    plain = {**w.base, "data": {**w.base["data"], "dir": str(w.root / "general-data")},
             "capture": {**w.base["capture"], "output": str(w.root / "general-capture")}}
    recipe = recipe_from_dict({**plain, "train": {"scope": "full", "interpolate": "auto", "device": "cpu",
                                                  "output": str(w.root / "interp-none")}}, base=w.root)
    with pytest.raises(ConfigError, match=r"`\[train\].interpolate = \"auto\"`.*holds no general-domain val rows.*\n"
                                          r"hint: .*--replay-val-fraction.*or set `interpolate = \"off\"`"):
        Trainer(recipe, w.root / "interp-none").setup()
