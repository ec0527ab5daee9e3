"""Coordinator load benchmark: 1,000 simulated providers against one coordinator process.

Starts `dflash-coordinator serve` on loopback (real SQLite in a temporary
directory), creates one provider token per simulated provider and a run with
one job per provider, then drives the providers from several asyncio client
processes (so the client side is not the bottleneck): every provider
registers, acquires a lease and keeps a Heartbeat stream open, sending at a
fixed per-provider rate with its own random phase.

Reported: operations/s and latency percentiles for Register, AcquireLease and
heartbeats at each offered rate. The baseline, measured in the same run
before the load starts, is one provider heartbeating alone on an idle
coordinator; the load phases print their p50/p99 as ratios against it.

Modes (`--modes`, default all three, in one run): `plaintext`, and `tls`: the
coordinator serves TLS (`--tls-cert/--tls-key`, a test CA and a loopback
certificate made by `tests/tls_certs.py`) and every provider opens its own TLS
channel. Each mode gets a fresh coordinator; the closing table prints TLS
against plaintext at each offered rate. `page`: plaintext with the status page
served (`--http-listen`); each rate runs on the same coordinator alternately
with no page open and with `--pages` status pages open (`--page-repeats`
times each, latencies pooled per side), each page fetching the refreshed part
(`/status.html`) every `--page-refresh` seconds as the browser does, from a
process at nice 19 (a browser runs on the viewer's machine, not the
coordinator's); the closing lines print heartbeat p99 with the pages open
against without.

    .venv/bin/python bench/coordinator.py [--providers 1000] [--procs 2] [--rates 1.1,1.5,2] [--seconds 10] [--modes plaintext,tls,page] [--pages 4] [--page-refresh 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "tests"))  # tls_certs, the test certificate factory

SPEC = json.dumps({"stages": ["train"], "recipe": {"steps": 100}, "data": "bench", "target": "tiny"})


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summary(name: str, lat: list[float], seconds: float, base: tuple[float, float] | None = None) -> str:
    ms = [x * 1000 for x in lat]
    line = f"{name:<28} {len(ms):>7} ops {len(ms) / seconds:>9.1f} ops/s   p50 {pct(ms, 50):7.2f} ms   p99 {pct(ms, 99):7.2f} ms   max {max(ms) if ms else float('nan'):7.2f} ms"
    if base:
        line += f"   (p50 x{pct(ms, 50) / base[0]:.2f}, p99 x{pct(ms, 99) / base[1]:.2f} vs baseline)"
    return line


# --- client process ---------------------------------------------------------


def aio_channel(address: str, ca_pem: bytes | None, options=None):
    """A grpc.aio channel: TLS trusting `ca_pem` when given, else plaintext."""
    import grpc

    if ca_pem is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca_pem), options=options)


async def _client_main(address: str, tokens: list[str], conn, channels: int, ca_pem: bytes | None) -> None:
    import grpc

    from dflash_worker.proto.dflash.v1 import provider_pb2, provider_pb2_grpc

    opts = [("grpc.use_local_subchannel_pool", 1)]
    chans = [aio_channel(address, ca_pem, opts) for _ in range(channels)]
    stubs = [provider_pb2_grpc.ProviderServiceStub(c) for c in chans]
    caps = provider_pb2.DeviceCapabilities(backend="cuda", device_count=1, memory_bytes=80 << 30, supports_bf16=True, platform="linux-x86_64")

    class P:
        pass

    provs = []
    for i, tok in enumerate(tokens):
        p = P()
        p.stub = stubs[i % len(stubs)]
        p.md = (("authorization", f"Bearer {tok}"),)
        provs.append(p)

    reg_lat, lease_lat = [], []

    async def register(p):
        t = time.perf_counter()
        r = await p.stub.Register(
            provider_pb2.RegisterRequest(client_version="0.1.0", protocol_version="dflash.v1", launch_mode=provider_pb2.LAUNCH_MODE_DOCKER, capabilities=caps, name="bench"),
            metadata=p.md,
            timeout=60,
        )
        reg_lat.append(time.perf_counter() - t)
        p.provider_id = r.provider_id

    async def lease(p):
        t = time.perf_counter()
        r = await p.stub.AcquireLease(provider_pb2.AcquireLeaseRequest(provider_id=p.provider_id, wait_seconds=0), metadata=p.md, timeout=60)
        lease_lat.append(time.perf_counter() - t)
        assert r.WhichOneof("result") == "lease", r
        p.lease_id = r.lease.lease_id

    conn.recv()  # "register"
    t0 = time.perf_counter()
    await asyncio.gather(*(register(p) for p in provs))
    conn.send(("register", reg_lat, time.perf_counter() - t0))
    conn.recv()  # "lease"
    t0 = time.perf_counter()
    await asyncio.gather(*(lease(p) for p in provs))
    conn.send(("lease", lease_lat, time.perf_counter() - t0))

    for p in provs:
        p.call = p.stub.Heartbeat(metadata=p.md)

    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, start_at, seconds, rate = msg
        lat: list[float] = []
        errors = [0]
        last_done = [start_at]
        interval = 1.0 / rate

        async def beat(p):
            loop = asyncio.get_running_loop()
            # Each provider ticks at `rate` with its own random phase.
            next_t = start_at + random.random() * interval
            step = 0
            while True:
                now = time.time()
                if next_t >= start_at + seconds:
                    return
                if next_t > now:
                    await asyncio.sleep(next_t - now)
                step += 1
                t = loop.time()
                try:
                    await p.call.write(provider_pb2.HeartbeatRequest(lease_id=p.lease_id, phase=provider_pb2.PHASE_TRAIN, step=step, total_steps=1000, metrics={"loss": 1.0 / step}))
                    r = await p.call.read()
                    if r.directive != provider_pb2.DIRECTIVE_CONTINUE:
                        errors[0] += 1
                    lat.append(loop.time() - t)
                    last_done[0] = max(last_done[0], time.time())
                except grpc.aio.AioRpcError:
                    errors[0] += 1
                    return
                next_t += interval

        await asyncio.gather(*(beat(p) for p in provs))
        conn.send(("heartbeat", lat, (errors[0], last_done[0])))

    for p in provs:
        await p.call.done_writing()
    for c in chans:
        await c.close()


def client_process(address: str, tokens: list[str], conn, channels: int, ca_pem: bytes | None) -> None:
    asyncio.run(_client_main(address, tokens, conn, channels, ca_pem))


def page_process(url: str, token: str, pages: int, refresh: float, conn) -> None:
    """`pages` open status pages: each fetches `url` every `refresh` seconds until told to stop.

    At the lowest priority (nice 19): a viewer's browser runs on the viewer's machine, and what is
    measured is the page's cost to the coordinator, not this process's share of the bench's cores."""
    import threading
    import urllib.request

    os.nice(19)

    stop = threading.Event()
    lat: list[float] = []
    errors = [0]

    def one(i: int) -> None:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        next_t = time.monotonic() + refresh * i / pages
        while not stop.is_set():
            delay = next_t - time.monotonic()
            if delay > 0 and stop.wait(delay):
                return
            t = time.perf_counter()
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    r.read()
                lat.append(time.perf_counter() - t)
            except OSError:
                errors[0] += 1
            next_t += refresh

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(pages)]
    for t in threads:
        t.start()
    conn.recv()  # "stop"
    stop.set()
    for t in threads:
        t.join(35)
    conn.send((lat, errors[0]))


# --- parent -----------------------------------------------------------------


def server_cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def start_server(workdir: Path, extra: list[str]) -> tuple[subprocess.Popen, dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_worker.coordinator", "serve", "--db", str(workdir / "c.db"), "--listen", "127.0.0.1:0", "--lease-ttl", "60", *extra],
        stdout=subprocess.PIPE,
        stderr=open(workdir / "server.log", "wb"),
        env=env,
    )
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout=30):
        proc.kill()
        raise SystemExit("coordinator did not start")
    return proc, json.loads(proc.stdout.readline())


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def baseline(address: str, token: str, ca_pem: bytes | None, n: int = 300) -> list[float]:
    """One provider alone: register, lease, then `n` sequential heartbeats on one stream."""
    from dflash_worker.proto.dflash.v1 import provider_pb2, provider_pb2_grpc

    async def go():
        async with aio_channel(address, ca_pem) as ch:
            stub = provider_pb2_grpc.ProviderServiceStub(ch)
            md = (("authorization", f"Bearer {token}"),)
            caps = provider_pb2.DeviceCapabilities(backend="cuda", device_count=1)
            r = await stub.Register(provider_pb2.RegisterRequest(client_version="0.1.0", protocol_version="dflash.v1", launch_mode=1, capabilities=caps), metadata=md)
            lease = (await stub.AcquireLease(provider_pb2.AcquireLeaseRequest(provider_id=r.provider_id), metadata=md)).lease
            call = stub.Heartbeat(metadata=md)
            lat = []
            loop = asyncio.get_running_loop()
            for i in range(n):
                t = loop.time()
                await call.write(provider_pb2.HeartbeatRequest(lease_id=lease.lease_id, phase=5, step=i, metrics={"loss": 1.0}))
                await call.read()
                lat.append(loop.time() - t)
                await asyncio.sleep(0.002)
            await call.done_writing()
            return lat[20:]  # drop warm-up

    return asyncio.run(go())


@dataclass
class Phase:
    """One heartbeat phase's outcome."""

    offered: float
    achieved: float
    p99_ms: float
    errors: int

    @property
    def met(self) -> bool:
        return self.achieved >= 1000 and self.p99_ms < 50 and self.errors == 0


def tls_files(workdir: Path) -> tuple[list[str], bytes]:
    """`serve` flags for TLS with a fresh test CA, and the CA's PEM for the clients."""
    from tls_certs import make_ca

    ca = make_ca(workdir / "ca")
    server = ca.server_cert(workdir / "server")
    return ["--tls-cert", str(server.cert), "--tls-key", str(server.key)], ca.cert.read_bytes()


def run_mode(mode: str, args) -> list[Phase]:
    """Start a coordinator in `mode`, run every phase against it, print the lines; return the heartbeat phases."""
    from dflash_worker.coordinator.client import AdminClient
    from dflash_worker.coordinator.tls import ClientTls
    from dflash_worker.proto.dflash.v1 import admin_pb2

    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        workdir = Path(tmp)
        extra, ca_pem = tls_files(workdir) if mode == "tls" else ([], None)
        if mode == "page":
            extra = ["--http-listen", "127.0.0.1:0", "--page-refresh", str(args.page_refresh)]
        proc, info = start_server(workdir, extra)
        address = info["address"]
        admin_token = Path(info["admin_token_file"]).read_text().strip()
        admin_url, admin_tls = (f"https://{address}", ClientTls(ca_file=workdir / "ca" / "ca.pem")) if ca_pem else (address, None)
        try:
            print(f"\n== {mode}: coordinator pid {info['pid']} on {address} (tls {info['tls']}); {os.cpu_count()} CPUs; {args.procs} client processes; {args.providers} providers")
            with AdminClient(admin_url, admin_token, tls=admin_tls) as admin:
                t0 = time.perf_counter()
                tokens = [admin.create_provider(f"bench-{i}") for i in range(args.providers + 1)]
                t_tok = time.perf_counter() - t0
                admin.create_run(admin_pb2.RunSpec(name="bench", spec_json=SPEC, required_client_version="0.1.0", num_jobs=args.providers + 1))
            print(f"setup: {len(tokens)} provider tokens in {t_tok:.2f} s ({len(tokens) / t_tok:.0f}/s, sequential admin calls)")

            base = baseline(address, tokens[-1], ca_pem)
            base_p = (pct([x * 1000 for x in base], 50), pct([x * 1000 for x in base], 99))
            print(summary("baseline: 1 provider hb", base, sum(base) + 0.002 * len(base)))
            page = (info["http_address"] + "/status.html", admin_token) if mode == "page" else None
            return load_phases(proc, address, tokens[:-1], ca_pem, base_p, args, page=page)  # tokens[-1]: the baseline's
        finally:
            stop_server(proc)


def heartbeat_phase(proc, pipes, providers: int, rate: float, base_p, args, page: tuple[str, str] | None) -> tuple[Phase, list[float]]:
    """One heartbeat phase at `rate` per provider (its outcome and latencies); with `page`, status pages refresh throughout it."""
    pager = None
    if page is not None:
        parent, child = mp.get_context("spawn").Pipe()
        pager = (mp.get_context("spawn").Process(target=page_process, args=(*page, args.pages, args.page_refresh, child), daemon=True), parent)
        pager[0].start()
    start_at = time.time() + 1.0
    cpu0 = server_cpu(proc.pid)
    for c in pipes:
        c.send(("heartbeat", start_at, args.seconds, rate))
    results = [c.recv() for c in pipes]
    cpu = server_cpu(proc.pid) - cpu0
    lat = [x for _, l, _ in results for x in l]
    errors = sum(e for _, _, (e, _) in results)
    # Achieved rate: completions over the time until the last one (>= the phase length).
    elapsed = max(args.seconds, max(d for _, _, (_, d) in results) - start_at)
    offered = providers * rate
    label = f"heartbeat @ {offered:.0f}/s offered" + (f", {args.pages} pages open" if page else "")
    print(summary(label, lat, elapsed, base_p) + f"   errors {errors}")
    # Load-independent cost: server CPU time per heartbeat (the box is shared, latency is not).
    print(f"{'':<28} server CPU {cpu / max(1, len(lat)) * 1e6:.0f} us per heartbeat ({cpu / elapsed * 100:.0f}% of one core)")
    if pager is not None:
        pager[1].send("stop")
        page_lat, page_errors = pager[1].recv()
        pager[0].join(30)
        print(summary(f"page refresh ({args.pages} pages)", page_lat, elapsed) + f"   errors {page_errors}")
    return Phase(offered=offered, achieved=len(lat) / elapsed, p99_ms=pct(lat, 99) * 1000, errors=errors), lat


def load_phases(proc, address: str, tokens: list[str], ca_pem: bytes | None, base_p, args, *, page: tuple[str, str] | None = None) -> list[Phase]:
    """Register, lease, then heartbeat at each rate from `args.procs` client processes.

    With `page` (the status page's URL and a token), each rate runs twice: without, then with
    `args.pages` pages refreshing; the returned list then holds both phases of each rate, in that order.
    """
    ctx = mp.get_context("spawn")
    shares = [tokens[i :: args.procs] for i in range(args.procs)]
    pipes, procs = [], []
    for share in shares:
        parent, child = ctx.Pipe()
        chans = args.channels or len(share)
        p = ctx.Process(target=client_process, args=(address, share, child, chans, ca_pem), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)

    for phase in ("register", "lease"):
        for c in pipes:
            c.send((phase,))
        results = [c.recv() for c in pipes]
        lat = [x for _, l, _ in results for x in l]
        wall = max(w for _, _, w in results)
        print(summary(f"{phase} ({len(lat)} concurrent)", lat, wall))

    phases = []
    for rate in [float(r) for r in args.rates.split(",")]:
        if page is None:
            phases.append(heartbeat_phase(proc, pipes, len(tokens), rate, base_p, args, None)[0])
            continue
        # Closed and open alternate `--page-repeats` times and each side's latencies are pooled, so a
        # drift in the machine's other load falls on both sides alike.
        pooled: dict[bool, list] = {False: [], True: []}
        for _ in range(args.page_repeats):
            for with_page in (False, True):
                pooled[with_page].append(heartbeat_phase(proc, pipes, len(tokens), rate, base_p, args, page if with_page else None))
        for with_page in (False, True):
            runs = pooled[with_page]
            lat = [x for _, l in runs for x in l]
            achieved = sum(p.achieved for p, _ in runs) / len(runs)
            phases.append(Phase(offered=runs[0][0].offered, achieved=achieved, p99_ms=pct(lat, 99) * 1000, errors=sum(p.errors for p, _ in runs)))
    met = [p.offered for p in phases if p.met]
    print("goal (>= 1000 heartbeats/s, p99 < 50 ms): " + (f"met, up to {max(met):.0f}/s offered" if met else "NOT met"))

    for c in pipes:
        c.send(("stop",))
    for p in procs:
        p.join(30)
    return phases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--providers", type=int, default=1000, help="simulated providers (default 1000)")
    ap.add_argument("--procs", type=int, default=2, help="client processes (default 2)")
    ap.add_argument("--channels", type=int, default=0, help="gRPC channels per client process (default 0: one per provider, like real providers)")
    ap.add_argument("--rates", default="1.1,1.5,2", help="heartbeats per second per provider, one phase each (default 1.1,1.5,2: 1,100 to 2,000 per second for 1,000 providers)")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each heartbeat phase (default 10)")
    ap.add_argument(
        "--modes", default="plaintext,tls,page", help="what to measure, each against its own coordinator: `plaintext`, `tls`, `page` (default all three)"
    )
    ap.add_argument("--pages", type=int, default=4, help="status pages open in the `page` mode (default 4)")
    ap.add_argument("--page-repeats", type=int, default=2, help="in the `page` mode, closed/open pairs per rate, alternating; latencies pooled per side (default 2)")
    ap.add_argument("--page-refresh", type=float, default=1.0, help="seconds between a page's refreshes in the `page` mode (default 1; the page's own default is 2)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= {"plaintext", "tls", "page"}:
        ap.error(f"--modes: `{args.modes}` is not a list of `plaintext`, `tls` and `page`")

    results = {mode: run_mode(mode, args) for mode in modes}
    transports = {m: r for m, r in results.items() if m != "page"}
    if transports:
        print("\n== heartbeats/s and p99 by transport" + (" (ratios: tls / plaintext)" if len(transports) == 2 else ""))
        first = next(iter(transports.values()))
        for i in range(len(args.rates.split(","))):
            cols = [f"{m}: {r[i].achieved:7.1f}/s p99 {r[i].p99_ms:6.2f} ms {'met' if r[i].met else 'NOT met'}" for m, r in transports.items()]
            line = f"@ {first[i].offered:5.0f}/s offered   " + "   ".join(cols)
            if len(transports) == 2:
                p, t = transports["plaintext"][i], transports["tls"][i]
                line += f"   (rate x{t.achieved / p.achieved:.2f}, p99 x{t.p99_ms / p.p99_ms:.2f})"
            print(line)
    if "page" in results:
        print(
            f"\n== heartbeat p99 with {args.pages} status pages open (refresh every {args.page_refresh:g} s) vs none, same coordinator,"
            f" {args.page_repeats} alternating phases each, pooled (goal: within 10%)"
        )
        r = results["page"]
        for closed, opened in zip(r[0::2], r[1::2], strict=True):
            ratio = opened.p99_ms / closed.p99_ms
            verdict = "within 10%" if ratio <= 1.10 else "NOT within 10%"
            print(
                f"@ {closed.offered:5.0f}/s offered   no page: p99 {closed.p99_ms:6.2f} ms   pages open: p99 {opened.p99_ms:6.2f} ms   (p99 x{ratio:.2f}, {verdict})"
                f"   errors {closed.errors + opened.errors}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
