"""The status page's HTML, rendered on the server from a `snapshot`; a few lines of vanilla JS refresh it.

No build step and no JavaScript framework: `render_page` writes the whole document once,
`render_status` the part that changes (runs, providers, the audit log), which the page's script fetches
from ``/status.html`` every few seconds and swaps in. The per-position acceptance plot is
an inline SVG drawn here from the gate's evaluation figures. Every value from the database
or a provider passes through `html.escape` (a provider chooses its name and metric keys).
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _when(unix: float | None) -> str:
    return "-" if not unix else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def _num(v: float | None, fmt: str = ".4f") -> str:
    return "-" if v is None else format(v, fmt)


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def plot_svg(released: list[float], trained: list[float], *, width: int = 360, height: int = 180) -> str:
    """Per-position acceptance (fraction of verify steps accepting at least k draft tokens), released vs trained."""
    n = max(len(released), len(trained))
    if n == 0:
        return '<p class="muted">no per-position figures</p>'
    left, right, top, bottom = 40, 10, 10, 30
    w, h = width - left - right, height - top - bottom

    def pts(values: list[float]) -> str:
        step = w / max(1, n - 1)
        return " ".join(f"{left + i * step:.1f},{top + h * (1 - max(0.0, min(1.0, v))):.1f}" for i, v in enumerate(values))

    grid = "".join(
        f'<line x1="{left}" x2="{left + w}" y1="{top + h * (1 - y):.1f}" y2="{top + h * (1 - y):.1f}" class="grid"/>'
        f'<text x="{left - 4}" y="{top + h * (1 - y) + 4:.1f}" text-anchor="end">{y:.1f}</text>'
        for y in (0.0, 0.5, 1.0)
    )
    ticks = "".join(
        f'<text x="{left + i * (w / max(1, n - 1)):.1f}" y="{top + h + 16}" text-anchor="middle">{i + 1}</text>' for i in range(n)
    )
    return (
        f'<svg class="plot" role="img" aria-label="per-position acceptance" viewBox="0 0 {width} {height}" width="{width}" height="{height}">'
        f"{grid}{ticks}"
        f'<polyline class="released" points="{pts(released)}"/><polyline class="trained" points="{pts(trained)}"/>'
        f'<text x="{left + w / 2:.0f}" y="{height - 2}" text-anchor="middle">block position k</text>'
        "</svg>"
        '<p class="legend"><span class="key released"></span> released <span class="key trained"></span> trained</p>'
    )


def _evaluation(run_id: str, job: dict[str, Any]) -> str:
    pub = job.get("publication")
    if not pub:
        return ""
    ev = pub.get("evaluation") or {}
    status = "published" if pub["published"] else "not published"
    override = f' <span class="override">override {_when(pub["override_unix"])}: {_e(pub["override_note"])}</span>' if pub.get("override_unix") else ""
    out = [f'<div class="publication {"ok" if pub["published"] else "held"}" data-published="{str(pub["published"]).lower()}">']
    out.append(f"<p><b>export {status}</b>: {_e(pub['reason'])}{override}</p>")
    if ev:
        counts = ev.get("counts", {})
        out.append(
            '<table class="evaluation"><tr><th></th><th>released</th><th>trained</th></tr>'
            f"<tr><th>acceptance length (pooled)</th><td>{_num(ev.get('tau_released'))}</td><td>{_num(ev.get('tau_trained'))}</td></tr>"
            f"<tr><th>acceptance length (per-prompt mean)</th><td>{_num(ev.get('tau_released_mean'))}</td><td>{_num(ev.get('tau_trained_mean'))}</td></tr>"
            "</table>"
            f'<table class="counts"><tr><th>verdict</th><th>improved</th><th>tied</th><th>regressed</th><th>prompts</th><th>split</th><th>tolerance</th></tr>'
            f"<tr><td>{_e(ev.get('verdict', pub['verdict']))}</td><td>{_e(counts.get('improved', 0))}</td><td>{_e(counts.get('tied', 0))}</td>"
            f"<td>{_e(counts.get('regressed', 0))}</td><td>{_e(ev.get('prompts', '-'))}</td><td>{_e(ev.get('split', '-'))}</td><td>{_e(ev.get('tolerance', '-'))}</td></tr></table>"
        )
        out.append(plot_svg(ev.get("per_position_released", []), ev.get("per_position_trained", [])))
    out.append("</div>")
    return "".join(out)


def _artifacts(run_id: str, job: dict[str, Any]) -> str:
    arts = job.get("artifacts") or []
    if not arts:
        return ""
    items = []
    for a in arts:
        label = f"{_e(a['name'])} <span class=\"muted\">{_e(a['kind'])}, {_size(a['size_bytes'])}</span>"
        if a["downloadable"]:
            href = f"/artifacts/{quote(run_id)}/{quote(job['job_id'])}/{quote(a['name'])}"
            items.append(f'<li><a class="download" href="{_e(href)}" download>{label}</a></li>')
        else:
            items.append(f'<li class="held">{label} <span class="muted">(not published)</span></li>')
    return f'<ul class="artifacts">{"".join(items)}</ul>'


def _progress(p: dict[str, Any] | None) -> str:
    if not p:
        return '<td colspan="6" class="muted">-</td>'
    step = f"{p['step']}/{p['total_steps']}" if p["total_steps"] else str(p["step"])
    return (
        f'<td class="phase">{_e(p["phase"])}</td><td class="step">{_e(step)}</td><td class="loss">{_num(p["loss"])}</td>'
        f'<td class="tps">{_num(p["tokens_per_s"], ".1f")}</td><td class="eta">{_duration(p["eta_seconds"])}</td>'
        f'<td class="hb">{_duration(p["heartbeat_age_seconds"])} ago</td>'
    )


def _run(r: dict[str, Any]) -> str:
    states = ", ".join(f"{_e(k)} {_e(v)}" for k, v in sorted(r["job_states"].items()))
    rows = []
    details = []
    for j in r["jobs"]:
        kind = j.get("kind", "pipeline")
        label = ""
        if kind != "pipeline":
            label = f' <span class="kind">{_e(kind)}' + (f' {j["shard_index"] + 1}/{j["shard_count"]}' if j["shard_count"] > 1 else "") + "</span>"
        rows.append(
            f'<tr class="job" data-job-id="{_e(j["job_id"])}" data-state="{_e(j["state"])}" data-kind="{_e(kind)}"><td><code>{_e(j["job_id"])}</code>{label}</td>'
            f'<td class="state">{_e(j["state"])}</td><td>{_e(j["attempts"])}</td>{_progress(j["progress"])}</tr>'
        )
        pending = (
            '<p class="muted pending-gate">export not decided yet: the regression gate decides on it when the run\'s evaluate job (shard 0) succeeds</p>'
            if j.get("pending_gate")
            else ""
        )
        extra = pending + _evaluation(r["run_id"], j) + _artifacts(r["run_id"], j)
        if extra:
            details.append(f'<div class="job-detail" data-job-id="{_e(j["job_id"])}"><h4>job <code>{_e(j["job_id"])}</code></h4>{extra}</div>')
    more = f'<p class="muted">{r["num_jobs"] - r["jobs_shown"]} more jobs not shown</p>' if r["num_jobs"] > r["jobs_shown"] else ""
    return (
        f'<section class="run" data-run-id="{_e(r["run_id"])}" data-state="{_e(r["state"])}">'
        f'<h3>{_e(r["name"])} <code>{_e(r["run_id"])}</code> <span class="badge {_e(r["state"])}">{_e(r["state"])}</span></h3>'
        f'<p class="muted">client {_e(r["client_version"])}, {_e(r["checkpoint_policy"])} checkpoints, created {_when(r["created_unix"])}; jobs: {states}</p>'
        '<table class="jobs"><tr><th>job</th><th>state</th><th>attempts</th><th>phase</th><th>step</th><th>loss</th><th>tokens/s</th><th>ETA</th><th>heartbeat</th></tr>'
        f"{''.join(rows)}</table>{more}{''.join(details)}</section>"
    )


def _provider(p: dict[str, Any]) -> str:
    d = p["device"]
    device = f"{_e(d['backend'] or '-')} x{_e(d['count'])}" + (f", {_size(d['memory_bytes'])}" if d["memory_bytes"] else "") + (f", {_e(d['platform'])}" if d["platform"] else "")
    lease = f"<code>{_e(p['lease']['job_id'])}</code> (run <code>{_e(p['lease']['run_id'])}</code>)" if p["lease"] else "-"
    version = _e(p["client_version"] or "-") + (f" (native {_e(p['native_client_version'])})" if p["native_client_version"] else "")
    revoked = ' <span class="badge failed">revoked</span>' if p["revoked"] else ""
    if p.get("quarantined") is not None:
        revoked += f' <span class="badge failed quarantined" title="{_e(p["quarantined"])}">quarantined</span>'
    return (
        f'<tr class="provider" data-provider-id="{_e(p["provider_id"])}"><td>{_e(p["identity"])}{revoked}</td><td>{_e(p["name"])}</td><td>{device}</td>'
        f'<td>{version}</td><td>{_when(p["last_heartbeat_unix"] or p["last_seen_unix"])}</td><td class="lease">{lease}</td></tr>'
    )


def _audit(entries: list[dict[str, Any]]) -> str:
    """The audit log's newest entries: quarantines (by the coordinator) and admins lifting them (who, from where, why)."""
    if not entries:
        return '<h2>Audit log</h2><p class="muted" id="audit">no quarantine recorded</p>'
    rows = "".join(
        f'<tr class="audit" data-action="{_e(a["action"])}" data-provider-id="{_e(a["provider_id"])}"><td>{_when(a["created_unix"])}</td>'
        f'<td>{_e(a["action"])}</td><td>{_e(a["provider"])} <code>{_e(a["provider_id"])}</code></td><td>{_e(a["peer"] or "coordinator")}</td>'
        f'<td class="reason">{_e(a["reason"])}' + (f'<br><span class="muted">lifted: {_e(a["detail"])}</span>' if a["detail"] else "") + "</td></tr>"
        for a in entries
    )
    return f'<h2>Audit log</h2><table id="audit"><tr><th>when</th><th>action</th><th>provider</th><th>by</th><th>reason</th></tr>{rows}</table>'


def status_parts(snap: dict[str, Any]) -> Iterator[str]:
    """`render_status` in pieces (a run, or 25 providers each), so a caller can pause between them."""
    yield '<h2>Runs</h2><div id="runs">'
    for r in snap["runs"]:
        yield _run(r)
    if not snap["runs"]:
        yield '<p class="muted">no runs yet</p>'
    if snap["runs_total"] > len(snap["runs"]):
        yield f'<p class="muted">showing the newest {len(snap["runs"])} of {snap["runs_total"]} runs</p>'
    yield (
        '</div><h2>Providers</h2><table id="providers"><tr><th>identity</th><th>registered name</th><th>device</th><th>version</th>'
        "<th>last heartbeat</th><th>current lease</th></tr>"
    )
    provs = snap["providers"]
    for i in range(0, len(provs), 25):
        yield "".join(_provider(p) for p in provs[i : i + 25])
    yield "</table>" + _audit(snap.get("audit") or [])
    yield f'<p class="muted" id="updated" data-now="{snap["now_unix"]:.3f}">as of {_when(snap["now_unix"])}</p>'


def render_status(snap: dict[str, Any]) -> str:
    """The refreshed part of the page: runs, then providers, then the audit log."""
    return "".join(status_parts(snap))


CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.5em}h3{font-size:1em;margin:.2em 0}h4{font-size:.95em;margin:.6em 0 .2em}
table{border-collapse:collapse;margin:.3em 0}th,td{border:1px solid #ccc;padding:2px 6px;text-align:left}th{background:#f3f3f3}
.muted{color:#777}.run{border:1px solid #ddd;padding:.5em .8em;margin:.6em 0;border-radius:4px}
.badge{font-size:.8em;padding:1px 6px;border-radius:8px;background:#eee}.badge.running{background:#dbeafe}.badge.finished{background:#dcfce7}.badge.failed{background:#fee2e2}
.publication.held{border-left:4px solid #dc2626;padding-left:.5em}.publication.ok{border-left:4px solid #16a34a;padding-left:.5em}
.plot text{font-size:10px;fill:#555}.plot .grid{stroke:#e5e5e5}.plot polyline{fill:none;stroke-width:2}
.plot .released,.key.released{stroke:#888;background:#888}.plot .trained,.key.trained{stroke:#2563eb;background:#2563eb}
.key{display:inline-block;width:12px;height:3px;vertical-align:middle}#live{float:right}
"""

JS = """
(function () {
  var box = document.getElementById("status"), live = document.getElementById("live");
  var every = parseInt(document.body.getAttribute("data-refresh-ms"), 10) || 2000, n = 0;
  function tick() {
    fetch("/status.html", {credentials: "same-origin", cache: "no-store"}).then(function (r) {
      if (r.status === 401) { window.location = "/login"; return null; }
      if (!r.ok) { throw new Error("HTTP " + r.status); }
      return r.text();
    }).then(function (text) {
      if (text === null) { return; }
      box.innerHTML = text; n += 1;
      document.body.setAttribute("data-refreshes", String(n));
      live.textContent = "live";
    }).catch(function (err) { live.textContent = "refresh failed: " + err.message; })
      .then(function () { setTimeout(tick, every); });
  }
  setTimeout(tick, every);
})();
"""


def render_page(status_html: str, *, role: str, refresh_ms: int) -> str:
    """The whole document around `render_status`'s HTML."""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>dflash coordinator</title>'
        '<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="stylesheet" href="/page.css"></head>'
        f'<body data-refresh-ms="{int(refresh_ms)}" data-refreshes="0" data-role="{_e(role)}">'
        f'<h1>dflash coordinator <span class="muted">({_e(role)})</span><span id="live" class="muted">loading</span></h1>'
        '<form method="post" action="/logout"><button type="submit">sign out</button></form>'
        f'<main id="status">{status_html}</main><script src="/page.js"></script></body></html>'
    )


def render_login(message: str = "") -> str:
    note = f'<p class="error" id="login-error">{_e(message)}</p>' if message else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>dflash coordinator: sign in</title>'
        '<link rel="stylesheet" href="/page.css"></head><body><h1>dflash coordinator</h1>'
        f"{note}"
        '<form method="post" action="/login"><label>admin or viewer token <input type="password" name="token" id="token" autocomplete="off" size="50"></label> '
        '<button type="submit" id="sign-in">sign in</button></form>'
        '<p class="muted">The token is in <code>viewer-token</code> (read-only) or <code>admin-token</code> next to the coordinator database.</p>'
        "</body></html>"
    )
