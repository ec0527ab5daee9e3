"""Where and how a job runs on this provider: the one place that applies `spec.json`'s
``device``, ``local_ranks`` and ``downgrades``.

The run-manager decides (``run-manager/src/policy.rs``: version, ranks, which missing
features are downgraded and which refused); the worker applies the result here:

- **device**: a recipe section's ``device = "auto"`` runs on the backend the
  run-manager detected and advertised to the coordinator (``device.backend``), not
  on whatever torch happens to find; a section that names the provider's backend
  runs as asked; one that names another backend is refused (the coordinator leased
  the job to a provider that cannot run it as written).
- **local_ranks**: a lease granting N ranks runs as N processes, which the run-manager
  starts with the `torch.distributed` environment (``WORLD_SIZE`` = N, ``RANK``, ...;
  `dflash_worker.dist`); a process whose ``WORLD_SIZE`` is not the lease's N is refused
  (it was not started as one of the lease's ranks).
- **downgrades**: the stand-ins ``policy.rs`` names (``DOWNGRADES`` there):
  ``torch_compile -> eager`` turns off the compiled flex-attention kernel of the
  draft's training forward (it uses SDPA instead); ``flash_attention_2 -> sdpa`` and
  ``liger -> torch`` are what this worker already runs (the teacher and the draft use
  SDPA and plain PyTorch kernels), so applying them changes no kernel. Every
  downgrade is recorded in the device provenance of each manifest, with its reason;
  an unknown feature or replacement is refused (the two sides disagree on the contract).

A hand-written ``spec.json`` without the run-manager's ``device`` runs standalone: devices
as the recipe says (``auto`` is whatever torch finds).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .spec import Downgrade, JobSpec

if TYPE_CHECKING:
    from ..device import DeviceChoice
    from ..recipe import Recipe

# feature -> replacement; mirrors `DOWNGRADES` in run-manager/src/policy.rs.
DOWNGRADES = {"flash_attention_2": "sdpa", "torch_compile": "eager", "liger": "torch"}
# what each downgrade changes in this worker
_EFFECT = {
    "flash_attention_2": "no change: this worker's attention is sdpa",
    "torch_compile": "draft training attention uses sdpa instead of compiled flex attention",
    "liger": "no change: this worker's kernels are plain torch",
}


def _started_world() -> int:
    """`WORLD_SIZE` of this process (1 when unset), read without importing torch."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable `WORLD_SIZE` is `{raw}`, not an integer") from None
    return max(world, 1)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """The applied device policy of one job; `device_for` is what every stage resolves through."""

    backend: str | None  # None: standalone, the recipe's `device` decides alone
    local_ranks: int = 1
    downgrades: tuple[Downgrade, ...] = ()

    @classmethod
    def from_spec(cls, spec: JobSpec) -> Placement:
        for d in spec.downgrades:
            want = DOWNGRADES.get(d.feature)
            if want is None:
                raise ConfigError(
                    f"spec.json downgrades `{d.feature}`, which this worker does not know; known: {', '.join(DOWNGRADES)}\n"
                    "hint: run-manager and dflash_worker come from one install; reinstall both"
                )
            if d.replacement != want:
                raise ConfigError(f"spec.json downgrades `{d.feature}` to `{d.replacement}`; this worker replaces it with `{want}`")
        world = _started_world()
        if spec.local_ranks != world:
            raise ConfigError(
                f"the lease grants {spec.local_ranks} local rank(s), but this process was started as one of {world} "
                f"(`WORLD_SIZE`)\nhint: let run-manager start the job; it starts one process per rank"
            )
        return cls(backend=spec.device.backend if spec.device else None, local_ranks=spec.local_ranks, downgrades=spec.downgrades)

    def downgraded(self, feature: str) -> bool:
        return any(d.feature == feature for d in self.downgrades)

    @property
    def draft_attention(self) -> str:
        """The draft training forward's attention backend (`DFlashDraft.forward_blocks`)."""
        return "sdpa" if self.downgraded("torch_compile") else "auto"

    def notes(self) -> tuple[str, ...]:
        """One line per applied downgrade, for provenance."""
        return tuple(f"downgrade `{d.feature}` -> `{d.replacement}` ({_EFFECT[d.feature]}): {d.reason}" for d in self.downgrades)

    def device_for(self, section: str, requested: str) -> DeviceChoice:
        """Resolve `[section].device = requested` on this provider (see the module docstring)."""
        from dataclasses import replace

        from ..device import resolve_device

        kind = (requested or "auto").strip().lower().split(":", 1)[0]
        if self.backend is None:
            choice = resolve_device(requested)
        elif kind == "auto":
            choice = resolve_device(self.backend)
            choice = replace(choice, requested=requested, notes=(f"`auto` pinned to the provider's backend `{self.backend}`",))
        elif kind == self.backend:
            choice = resolve_device(requested)
        else:
            raise ConfigError(
                f"`[{section}].device` is `{requested}` but this provider runs `{self.backend}`\n"
                f"hint: use `auto`, or create the run with `--feature {kind}` so only {kind} providers lease it"
            )
        return replace(choice, notes=choice.notes + self.notes())

    def devices(self, recipe: Recipe) -> dict[str, DeviceChoice]:
        """`device_for` of every recipe section that runs on a device (absent `[evaluate]`: its default)."""
        from ..recipe import EvaluateConfig

        sections = {"capture": recipe.capture, "train": recipe.train, "evaluate": recipe.evaluate or EvaluateConfig()}
        return {name: self.device_for(name, sec.device) for name, sec in sections.items() if sec is not None}
