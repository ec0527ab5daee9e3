"""The general-domain guard: `prepare-data --replay-val-fraction` holds general rows out into val,
training validates them apart from the own rows, measures the released draft on them before the
first update, and selection never picks a checkpoint that forgot the general domain.

The world: a tiny target, and a draft "released" by training it here on general rows (words in
`WORDS` order). The own domain spells every word backwards, so fitting it overwrites what the
released draft learned: a run adapting to it gains own acceptance while its general acceptance
falls far below the released draft's within a few steps. The guard must reject those checkpoints
and select an earlier one, where the same run without the guard (`general_tolerance = 1`) selects
a later one; both runs train bit-identically, only the selection differs.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from guard_world import TOLERANCE, GuardWorld

from dflash_worker.errors import ConfigError
from dflash_worker.manifest import sha256_file
from dflash_worker.recipe import load_recipe, recipe_from_dict
from dflash_worker.train import StopFlags, train
from dflash_worker.train import checkpoint as ckpt

sys.path.insert(0, str(Path(__file__).parent))
from pipeline import _toml  # noqa: E402
from prewarmed import worker_cli


@pytest.fixture(scope="module")
def world(guard_world) -> GuardWorld:
    """The guard world (`guard_world.build`), one per session: tests/train/test_interpolate.py uses it too."""
    return guard_world


@pytest.fixture(scope="module")
def shuffled(world) -> GuardWorld:
    """Own rows that are the general rows with their labels shuffled: each response's words in a
    random order, so fitting them unlearns the word order the released draft knows."""
    from dflash_worker.capture import run_capture
    from dflash_worker.data import prepare_data
    from dflash_worker.recipe import recipe_from_dict

    rng = random.Random(3)
    rows = []
    for line in world.general.read_text().splitlines():
        row = json.loads(line)
        words = row["response"].split()
        rng.shuffle(words)
        rows.append({"prompt": "s" + row["prompt"], "response": " ".join(words)})
    own = world.root / "shuffled.jsonl"
    own.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data, capture = world.root / "shuffled-data", world.root / "shuffled-capture"
    prepare_data([own], data, seed=0, val_fraction=0.25, test_fraction=0.0, replay=[world.general],
                 replay_fraction=0.0, replay_val_fraction=0.25)
    base = {**world.base, "data": {**world.base["data"], "dir": str(data)},
            "capture": {**world.base["capture"], "output": str(capture)}}
    run_capture(recipe_from_dict(base, base=world.root))
    return GuardWorld(world.root, base, world.general, own)


def _selection(run: Path) -> dict:
    return json.loads((run / "selection.json").read_text())


def _general(entry: dict) -> float:
    return entry["general_matching_proposals"]


def test_the_guard_rejects_checkpoints_that_forgot_and_selects_an_earlier_one(world):
    events = []
    guarded = train(load_recipe(world.recipe("guarded", general_tolerance=TOLERANCE)), on_event=events.append)
    assert train(load_recipe(world.recipe("free", general_tolerance=1.0))).status == "completed"
    g, f = _selection(world.root / "guarded"), _selection(world.root / "free")
    guard = g["guard"]

    # the same training either way: only the selection differs
    assert g["history"] == f["history"] and len(g["history"]) == 12
    released = guard["released_general_matching_proposals"]
    assert released > 0.5 and guard["floor"] == pytest.approx((1 - TOLERANCE) * released)
    assert f["guard"]["released_general_matching_proposals"] == released
    # the released draft was measured once, before the first update, and said so
    assert any(getattr(e, "message", "").startswith("released draft: general-domain matching proposals") for e in events)

    # the run forgot: its last checkpoint keeps less than half the released draft's general acceptance
    last = guard["checkpoints"][-1]
    assert _general(last) < 0.75 * released

    # without the guard, the best own checkpoint is a late one that forgot
    best_own = max(f["history"], key=lambda h: (h["matching_proposals"], -h["step"]))
    assert f["step"] == best_own["step"] and not f["guard"]["rejected_steps"] and f["guard"]["passed"]
    assert _general(best_own) < guard["floor"]

    # with it: every checkpoint below the floor is rejected (the free run's choice among them), and
    # the selection is the best own checkpoint among those kept, an earlier step
    rejected = {c["step"] for c in guard["checkpoints"] if _general(c) < guard["floor"]}
    assert set(guard["rejected_steps"]) == rejected and f["step"] in rejected
    kept = [c for c in guard["checkpoints"] if not c["rejected"]]
    assert guard["passed"] and kept
    assert g["step"] == max(kept, key=lambda c: (c["matching_proposals"], -c["step"]))["step"] < f["step"]
    assert g["validation"]["general"]["matching_proposals"] >= guard["floor"]
    assert g["validation"]["matching_proposals"] < best_own["matching_proposals"]
    assert "rejected steps" in guarded.message and guarded.export_dir is not None
    assert json.loads((guarded.export_dir / "manifest.json").read_text())["provenance"]["checkpoint"]["step"] == g["step"]

    # metrics carry both validations; the checkpoints carry the baseline
    lines = [json.loads(x) for x in (world.root / "guarded" / "metrics.jsonl").read_text().splitlines()]
    validated = [x for x in lines if "val" in x]
    assert [x["step"] for x in validated] == [h["step"] for h in g["history"]]
    assert all(x["val_general"]["matching_proposals"] == _general(h) for x, h in zip(validated, g["history"]))
    state = ckpt.load(world.root / "guarded" / ckpt.CHECKPOINTS / ckpt.step_name(g["step"])).state
    assert state["released_general"]["matching_proposals"] == released and state["released_general"]["examples"] == 15


def test_no_checkpoint_passing_selects_the_released_draft_itself_and_says_so(world):
    import torch
    from safetensors.torch import load_file

    events = []
    res = train(load_recipe(world.recipe("strict", general_tolerance=0.0, steps=8, lr=3e-2, warmup_steps=0)),
                on_event=events.append)
    run = world.root / "strict"
    sel = _selection(run)
    guard = sel["guard"]
    # lr 3e-2 from the first step: every checkpoint forgot, none keeps the released value exactly
    assert not guard["passed"] and guard["tolerance"] == 0.0
    assert guard["rejected_steps"] == [c["step"] for c in guard["checkpoints"]] == [2, 4, 6, 8]
    # so the run selects step 0, the released draft as loaded, committed before the first update and never pruned
    assert sel["step"] == 0 and sel["checkpoint"] == ckpt.step_name(0)
    assert [s for s, _ in ckpt.committed(run)] == [0, 6, 8]  # keep_checkpoints 2, plus step 0
    released = ckpt.load(run / ckpt.CHECKPOINTS / ckpt.step_name(0)).state["released_general"]
    assert sel["validation"]["general"]["matching_proposals"] == guard["released_general_matching_proposals"]
    # measured on the own rows too (backwards words: the released draft matches none of them)
    assert sel["validation"]["matching_proposals"] == released["own"]["matching_proposals"] == 0.0
    assert sel["validation"]["blocks"] == released["own"]["blocks"] > 0
    # the export holds the released draft's values, tensor for tensor
    ours = load_file(str(res.export_dir / "model.safetensors"))
    theirs = load_file(str(world.root / "release" / "export" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    assert any(getattr(e, "level", "") == "warning" and e.message.startswith("the export is the released draft (it adapts nothing)")
               for e in events)
    assert "no checkpoint passed the general-domain guard" in res.message


def test_on_shuffled_general_labels_the_guard_selects_before_the_forgetting_and_patience_stops_the_run(shuffled):
    kw = dict(general_tolerance=TOLERANCE)
    events = []
    res = train(load_recipe(shuffled.recipe("shuf-stop", guard_patience=2, **kw)), on_event=events.append)
    # the same run without the guard (tolerance 1) and without patience: it trains every step
    assert train(load_recipe(shuffled.recipe("shuf-free", general_tolerance=1.0))).status == "completed"
    g, f = _selection(shuffled.root / "shuf-stop"), _selection(shuffled.root / "shuf-free")
    guard = g["guard"]

    # trained on shuffled labels the run forgets: it ends below the floor, and without the guard it
    # selects a checkpoint that forgot
    assert f["guard"]["stopped_at"] is None and f["guard"]["patience"] == 0
    assert _general(f["guard"]["checkpoints"][-1]) < 0.5 * guard["released_general_matching_proposals"]
    free_pick = next(c for c in f["guard"]["checkpoints"] if c["step"] == f["step"])
    assert _general(free_pick) < guard["floor"] and f["step"] > g["step"]
    # patience 2 stopped the run at the second rejection in a row, which the full run also shows
    stopped = guard["stopped_at"]
    assert guard["patience"] == 2 and stopped is not None and stopped < 24
    marks = [c["rejected"] for c in guard["checkpoints"]]
    assert marks[-2:] == [True, True] and [c["step"] for c in guard["checkpoints"]][-1] == stopped
    assert not any(a and b for a, b in zip(marks[:-2], marks[1:-1])), "it should have stopped earlier"
    # the same training up to the stop: the stopped run's history is the full run's prefix
    assert g["history"] == f["history"][: len(g["history"])]
    assert [json.loads(x)["step"] for x in (shuffled.root / "shuf-stop" / "metrics.jsonl").read_text().splitlines()] \
        == list(range(1, stopped + 1))
    # it selected an earlier checkpoint the guard kept, and said that the guard stopped it
    assert guard["passed"] and not next(c for c in guard["checkpoints"] if c["step"] == g["step"])["rejected"]
    assert g["step"] < stopped and g["validation"]["general"]["matching_proposals"] >= guard["floor"]
    assert res.status == "completed" and res.step == stopped and "stopped by the general-domain guard" in res.message
    assert any(getattr(e, "message", "").startswith(f"the general-domain guard stopped the run at step {stopped}/24")
               for e in events)
    assert json.loads((res.export_dir / "manifest.json").read_text())["provenance"]["checkpoint"]["step"] == g["step"]

    # a crash after the stop's checkpoint but before selection: the resumed run stays stopped
    run = shuffled.root / "shuf-stop"
    before = ckpt.load(run / ckpt.CHECKPOINTS / ckpt.step_name(stopped)).state["val_history"]
    (run / "selection.json").unlink()
    again = train(load_recipe(shuffled.recipe("shuf-stop", guard_patience=2, **kw)), resume=True)
    assert again.status == "completed" and again.step == stopped
    assert _selection(run)["step"] == g["step"] and _selection(run)["guard"] == guard
    assert ckpt.load(run / ckpt.CHECKPOINTS / ckpt.step_name(stopped)).state["val_history"] == before


@pytest.mark.parametrize("bad", [-1, 1.5, "2"])
def test_guard_patience_is_a_count(world, bad):
    raw = dict(world.base, train={"scope": "full", "guard_patience": bad})
    with pytest.raises(ConfigError, match="guard_patience"):
        recipe_from_dict(raw, base=world.root)


def test_a_guarded_run_resumes_bit_identical(world):
    kw = dict(general_tolerance=TOLERANCE, steps=8, checkpoint_every=1)
    ref = train(load_recipe(world.recipe("res-ref", **kw)))
    flags = StopFlags()
    flags.request_stop("test")
    assert train(load_recipe(world.recipe("res", **kw)), flags=flags).status == "stopped"
    done = train(load_recipe(world.recipe("res", **kw)), resume=True)
    assert done.status == "completed" and ref.status == "completed"
    a, b = world.root / "res-ref", world.root / "res"
    sa, sb = _selection(a), _selection(b)
    for key in ("step", "validation", "history", "guard"):
        assert sa[key] == sb[key], key
    last = ckpt.step_name(8)
    for name in ("trainable.safetensors", "optimizer.pt"):
        assert sha256_file(a / ckpt.CHECKPOINTS / last / name) == sha256_file(b / ckpt.CHECKPOINTS / last / name)
    state_a, state_b = (ckpt.load(r / ckpt.CHECKPOINTS / last).state for r in (a, b))
    assert state_a["released_general"] == state_b["released_general"] and state_a["val_history"] == state_b["val_history"]
    metrics = lambda r: [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [x.get("val_general") for x in metrics(a)] == [x.get("val_general") for x in metrics(b)]
    assert [x["step"] for x in metrics(b)] == list(range(1, 9))


def test_prepare_holds_general_rows_out_of_train_and_tags_them(world, tmp_path):
    from dflash_worker.data import prepare_data

    own, general = world.own, world.general
    plain = prepare_data([own], tmp_path / "plain", seed=3, replay=[general], replay_fraction=0.3)
    m = prepare_data([own], tmp_path / "out", seed=3, replay=[general], replay_fraction=0.3, replay_val_fraction=0.1)
    again = prepare_data([own], tmp_path / "again", seed=3, replay=[general], replay_fraction=0.3, replay_val_fraction=0.1)
    assert m == again and (tmp_path / "out" / "val.jsonl").read_bytes() == (tmp_path / "again" / "val.jsonl").read_bytes()
    rows = {s: [json.loads(x) for x in (tmp_path / "out" / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "val")}
    general_val = [r for r in rows["val"] if r.get("domain") == "general"]
    assert [r["id"] for r in general_val] == m["replay"]["val_ids"] and m["replay"]["val_rows"] == 6 == round(0.1 * 60)
    assert all(r["source"] == "general.jsonl" for r in general_val)
    assert not any("domain" in r for r in rows["train"]) and all(r["source"] == "own.jsonl" for r in rows["val"] if "domain" not in r)
    prompts = lambda rs: {r["messages"][0]["content"] for r in rs}  # noqa: E731
    assert not prompts(general_val) & prompts(rows["train"])
    # a large pool: train takes the rows it takes without a held-out set, the own split is unchanged
    plain_train = (tmp_path / "plain" / "train.jsonl").read_bytes()
    assert (tmp_path / "out" / "train.jsonl").read_bytes() == plain_train and m["replay"]["rows"] == plain["replay"]["rows"]
    assert m["split_fingerprint"] != plain["split_fingerprint"] and m["params"]["replay"]["val_fraction"] == 0.1
    assert "val_ids" not in plain["replay"] and "val_fraction" not in plain["params"]["replay"]
    # the CLI flag, and its summary line
    res = worker_cli("prepare-data", "--input", own, "--replay", general, "--replay-fraction", "0.3", "--replay-val-fraction", "0.1",
                     "--seed", "3", "--output", tmp_path / "cli", timeout=120)
    assert res.returncode == 0, res.stderr
    assert "held out 6 replay rows in val as general-domain validation rows" in res.stdout
    assert (tmp_path / "cli" / "manifest.json").read_bytes() == (tmp_path / "out" / "manifest.json").read_bytes()
    with pytest.raises(ConfigError, match="--replay-val-fraction"):
        prepare_data([own], tmp_path / "x", replay=[general], replay_val_fraction=1.0)


def test_replay_fraction_zero_holds_general_rows_for_the_guard_alone(world, tmp_path):
    """`--replay-fraction 0 --replay-val-fraction F`: the general rows go to val for the guard, none to train."""
    from dflash_worker.data import prepare_data

    own, general = world.own, world.general
    none = prepare_data([own], tmp_path / "none", seed=3)
    m = prepare_data([own], tmp_path / "out", seed=3, replay=[general], replay_fraction=0.0, replay_val_fraction=0.1)
    assert m["replay"]["rows"] == 0 and m["replay"]["wanted_rows"] == 0 and not m["replay"]["short"]
    assert m["replay"]["val_rows"] == 6 and len(m["replay"]["val_ids"]) == 6
    # train is byte for byte the train of the same inputs prepared without replay
    assert (tmp_path / "out" / "train.jsonl").read_bytes() == (tmp_path / "none" / "train.jsonl").read_bytes()
    assert m["counts"]["split"]["train"] == none["counts"]["split"]["train"]
    assert m["counts"]["split"]["val"] == none["counts"]["split"]["val"] + 6
    val = [json.loads(x) for x in (tmp_path / "out" / "val.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in val if r.get("domain") == "general") == sorted(m["replay"]["val_ids"])
    res = worker_cli("prepare-data", "--input", own, "--replay", general, "--replay-fraction", "0", "--replay-val-fraction",
                     "0.1", "--seed", "3", "--output", tmp_path / "cli", timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "cli" / "manifest.json").read_bytes() == (tmp_path / "out" / "manifest.json").read_bytes()
    # without a held-out set, 0 would be a replay that replays nothing: refused, naming the flag that makes it useful
    with pytest.raises(ConfigError, match="--replay-val-fraction"):
        prepare_data([own], tmp_path / "x", replay=[general], replay_fraction=0.0)
    with pytest.raises(ConfigError, match="no `--replay` file"):
        prepare_data([own], tmp_path / "x", replay_val_fraction=0.1)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "3%", True])
def test_general_tolerance_is_a_share(world, bad):
    raw = dict(world.base, train={"scope": "full", "general_tolerance": bad})
    with pytest.raises(ConfigError, match="general_tolerance"):
        recipe_from_dict(raw, base=world.root)


def test_checkpoints_from_before_the_key_resume_with_the_default_tolerance():
    from dflash_worker.errors import ResumeError
    from dflash_worker.train.resume import compare_for_resume

    saved = {"recipe_view": {"train.lr": 1.0}, "data_fingerprint": "d", "draft_fingerprint": {}}
    compare_for_resume(saved, {**saved, "recipe_view": {"train.lr": 1.0, "train.general_tolerance": 0.03}})
    compare_for_resume(saved, {**saved, "recipe_view": {"train.lr": 1.0, "train.guard_patience": 0}})
    with pytest.raises(ResumeError, match="`train.general_tolerance`"):
        compare_for_resume(saved, {**saved, "recipe_view": {"train.lr": 1.0, "train.general_tolerance": 0.1}})
    with pytest.raises(ResumeError, match="`train.guard_patience`"):
        compare_for_resume(saved, {**saved, "recipe_view": {"train.lr": 1.0, "train.guard_patience": 3}})


# --------------------------------------------------------------------------- replay distillation


@pytest.fixture(scope="module")
def replayed(world) -> GuardWorld:
    """The own rows (words backwards) with a quarter of train made of general replay rows, and general
    rows held out into val: what `[train].replay_kd` distils on and what the guard measures."""
    from dflash_worker.capture import run_capture
    from dflash_worker.data import prepare_data

    data, capture = world.root / "replayed-data", world.root / "replayed-capture"
    m = prepare_data([world.own], data, seed=0, val_fraction=0.25, test_fraction=0.0, replay=[world.general],
                     replay_fraction=0.25, replay_val_fraction=0.25)
    train_rows = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    assert m["replay"]["rows"] > 0 and m["replay"]["train_ids"] == [r["id"] for r in train_rows if r["source"] == "general.jsonl"]
    base = {**world.base, "data": {**world.base["data"], "dir": str(data)},
            "capture": {**world.base["capture"], "output": str(capture)}}
    run_capture(recipe_from_dict(base, base=world.root))
    return GuardWorld(world.root, base, world.general, world.own)


def _trainer(w: GuardWorld, run: str, **kw):
    from dflash_worker.train.loop import Trainer

    t = Trainer(load_recipe(w.recipe(run, **kw)), w.root / run)
    t.setup()
    return t


def _general_kl(t) -> float:
    """Mean KL per valid position from the released draft's block distributions to the trained draft's,
    on the general val rows (weights as trained)."""
    import torch

    from dflash_worker.train.objectives import kd_loss_sum

    total = positions = 0.0
    with torch.no_grad():
        for b in t.validator.blocks(t.parts.val_general):
            ones = torch.ones_like(t.parts.weights.positions)
            total += float(kd_loss_sum(t.scorer.forward(b.seq, b.anchors)[1], t.scorer.start_logits(b), b.valid, ones))
            positions += float(b.valid.sum())
    return total / positions


def test_replay_kd_distils_on_the_replay_rows_toward_the_released_draft(replayed):
    import torch

    from dflash_worker.train.data import sample_anchors

    t = _trainer(replayed, "kd-probe", replay_kd=1.0, steps=12)
    manifest_ids = set(t.parts.train_split.reader.manifest["data"]["replay"]["train_ids"])
    rows = t.parts.replay_rows
    assert rows and {t.parts.train_split.id_of(i) for i in rows} == manifest_ids
    assert all(t.parts.train_split.id_of(i) not in manifest_ids for i in set(range(len(t.parts.train_split))) - rows)
    seq = t.parts.train_split.get(min(rows))
    b = t.scorer.blocks(seq, sample_anchors(seq.loss_mask, 4, 7), replay=True)
    # before any update the starting draft is the draft itself: the same logits, bit for bit
    assert torch.equal(t.scorer.start_logits(b), t.scorer.forward(b.seq, b.anchors)[1])
    lines = [t.train_step() for _ in range(12)]
    replay_steps = [x["step"] for x in lines if x["samples"][0] in manifest_ids]
    assert replay_steps and len(replay_steps) < len(lines)  # both kinds of rows were trained
    for x in lines:  # the term is there on replay rows only, and 0 until the first update moved the draft
        assert (x["replay_kd"] > 0) == (x["step"] in replay_steps and x["step"] > 1), x
    # the swap puts the trained tensors back: the same storage, the same values
    ptrs, values = [p.data_ptr() for p in t.parts.params], [p.detach().clone() for p in t.parts.params]
    start, now = t.scorer.start_logits(b), t.scorer.forward(b.seq, b.anchors)[1]
    assert not torch.equal(start, now)
    assert [p.data_ptr() for p in t.parts.params] == ptrs and all(torch.equal(p, v) for p, v in zip(t.parts.params, values))
    assert all(torch.equal(p, s) for p, s in zip(t.parts.start, (q.detach() for q in _trainer(replayed, "kd-fresh", replay_kd=1.0).parts.params)))


def test_replay_kd_keeps_the_general_domain_closer_to_the_released_draft(replayed):
    # 60 steps, 14 of them on replay rows. Measured on this world (general val KL to the released
    # draft, replay only -> replay + kd): kd 4: 0.0152 -> 0.0145, kd 20: 0.0130, kd 100: 0.0108; the
    # draft is far from converged here (loss ~8), so the pull is weak at small weights; the bench
    # measures it on trained drafts (docs/effectiveness.md)
    steps = 60
    plain, kd = _trainer(replayed, "kd-off", steps=steps), _trainer(replayed, "kd-on", replay_kd=100.0, steps=steps)
    assert plain.parts.start is None  # kept only for l2sp or replay_kd: the probe gives it the released values
    object.__setattr__(plain.parts, "start", [p.detach().clone() for p in plain.parts.params])
    seen = [[t.train_step()["samples"] for _ in range(steps)] for t in (plain, kd)]
    assert seen[0] == seen[1]  # the same rows in the same order: only the loss differs
    kl_plain, kl_kd = _general_kl(plain), _general_kl(kd)
    print(f"general val KL to the released draft: replay only {kl_plain:.4f}, replay + kd 100 {kl_kd:.4f}")
    assert kl_kd < 0.85 * kl_plain


def test_replay_kd_needs_replay_rows_in_train(world):
    with pytest.raises(ConfigError, match=r"replay_kd.*none of the 0"):
        _trainer(world, "kd-none", replay_kd=1.0)
    raw = dict(world.base, train={"scope": "full", "replay_kd": -0.5})
    with pytest.raises(ConfigError, match="replay_kd"):
        recipe_from_dict(raw, base=world.root)


def test_a_replay_kd_run_resumes_bit_identical(replayed):
    kw = dict(replay_kd=1.0, general_tolerance=TOLERANCE, steps=6, checkpoint_every=1)
    ref = train(load_recipe(replayed.recipe("kd-res-ref", **kw)))
    flags = StopFlags()
    flags.request_stop("test")
    assert train(load_recipe(replayed.recipe("kd-res", **kw)), flags=flags).status == "stopped"
    assert train(load_recipe(replayed.recipe("kd-res", **kw)), resume=True).status == "completed" == ref.status
    a, b = replayed.root / "kd-res-ref", replayed.root / "kd-res"
    last = ckpt.step_name(6)
    for name in ("trainable.safetensors", "optimizer.pt"):
        assert sha256_file(a / ckpt.CHECKPOINTS / last / name) == sha256_file(b / ckpt.CHECKPOINTS / last / name)
    metrics = lambda r: [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [x["replay_kd"] for x in metrics(a)] == [x["replay_kd"] for x in metrics(b)]
    assert any(x["replay_kd"] > 0 for x in metrics(a))


def test_the_keep_general_preset_distils_guards_and_needs_general_val_rows(replayed, world):
    """`preset = "keep_general"` (the adopted adaptation): a run with only the preset and a step count
    distils on the replay rows, validates every steps // 8, and guards the selection at tolerance 0.02
    with patience 4; on data without general val rows it stops at setup and names the fix."""
    out = replayed.root / "keep-general"
    raw = dict(replayed.base, train={"preset": "keep_general", "steps": 16, "blocks_per_sequence": 4,
                                     "val_examples": 16, "device": "cpu", "output": str(out)})
    (replayed.root / "keep-general.toml").write_text(_toml(raw))
    res = train(load_recipe(replayed.root / "keep-general.toml"))
    assert res.status == "completed"
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(x.get("replay_kd", 0) > 0 for x in lines)
    validated = [x["step"] for x in lines if "val_general" in x]
    assert validated == list(range(2, validated[-1] + 1, 2))  # every 16 // 8 steps
    guard = _selection(out)["guard"]
    assert (guard["tolerance"], guard["patience"]) == (0.02, 4)
    assert [c["step"] for c in guard["checkpoints"]] == validated
    # it ran every step, or patience stopped it after 4 rejected validations in a row
    assert validated[-1] == 16 or (guard["stopped_at"] == validated[-1] and guard["rejected_steps"][-4:] == validated[-4:])
    # the released draft's own general data: no general rows in val
    plain = dict(world.base, data={**world.base["data"], "dir": str(world.root / "general-data")},
                 capture={**world.base["capture"], "output": str(world.root / "general-capture")},
                 train={"preset": "keep_general", "steps": 16, "device": "cpu", "output": str(world.root / "keep-none")})
    (world.root / "keep-none.toml").write_text(_toml(plain))
    with pytest.raises(ConfigError, match=r"keep_general.*general-domain val rows.*holds none.*\n.*--replay-val-fraction"):
        train(load_recipe(world.root / "keep-none.toml"))


@pytest.fixture(scope="module")
def mixed(world) -> GuardWorld:
    """The own rows in both thinking modes (`"thinking"` alternating; the general rows carry no
    reasoning, so they are `off`), prepared and captured with `[data].thinking = "per_row"`."""
    from dflash_worker.capture import run_capture
    from dflash_worker.data import prepare_data
    from dflash_worker.recipe import recipe_from_dict

    rows = [{**json.loads(line), "thinking": i % 2 == 0} for i, line in enumerate(world.own.read_text().splitlines())]
    own = world.root / "mixed.jsonl"
    own.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data, capture = world.root / "mixed-data", world.root / "mixed-capture"
    prepare_data([own], data, seed=0, val_fraction=0.25, test_fraction=0.0, replay=[world.general],
                 replay_fraction=0.0, replay_val_fraction=0.25)
    base = {**world.base, "data": {**world.base["data"], "dir": str(data), "thinking": "per_row"},
            "capture": {**world.base["capture"], "output": str(capture)}}
    run_capture(recipe_from_dict(base, base=world.root))
    return GuardWorld(world.root, base, world.general, own)


def test_per_row_thinking_validates_and_guards_each_mode(mixed):
    from dflash_worker.train import selection

    res = train(load_recipe(mixed.recipe("mixed-guarded", steps=8, general_tolerance=TOLERANCE)))
    assert res.status == "completed"
    sel = _selection(mixed.root / "mixed-guarded")
    state = ckpt.load(mixed.root / "mixed-guarded" / ckpt.CHECKPOINTS / ckpt.step_name(sel["step"])).state
    released, history = state["released_general"], state["val_history"]
    # the released draft was measured on both modes, before the first update
    assert sorted(released["modes"]) == ["off", "on"] and all(m["blocks"] > 0 for m in released["modes"].values())
    for entry in [released, *history]:
        own = entry["own"] if entry is released else entry
        general = entry if entry is released else entry["general"]
        modes = entry["modes"]
        # the modes split exactly the rows scored (own and general), no block scored twice or lost
        assert sum(m["blocks"] for m in modes.values()) == own["blocks"] + general["blocks"]
        pooled = sum(m["matching_proposals"] * m["blocks"] for m in modes.values()) / sum(m["blocks"] for m in modes.values())
        both = (own["matching_proposals"] * own["blocks"] + general["matching_proposals"] * general["blocks"]) / (
            own["blocks"] + general["blocks"])
        assert pooled == pytest.approx(both, rel=1e-12)
    guard = sel["guard"]
    assert sel["rule"] == selection.GUARDED_RULE + selection.MODES_RULE
    for mode, g in guard["modes"].items():
        assert g["released_matching_proposals"] == released["modes"][mode]["matching_proposals"]
        assert g["floor"] == pytest.approx((1 - TOLERANCE) * g["released_matching_proposals"])
    # a checkpoint is rejected exactly when its general figure or any mode fell below its floor
    for c, v in zip(guard["checkpoints"], [h for h in history if h["blocks"] > 0]):
        below = [m for m in guard["modes"] if v["modes"][m]["matching_proposals"] < guard["modes"][m]["floor"]]
        assert c["modes_below"] == below
        assert c["rejected"] == (bool(below) or v["general"]["matching_proposals"] < guard["floor"])
