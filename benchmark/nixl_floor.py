"""The floor under one-sided NIXL transfers between two processes on one device.

Why this exists: Xavier's direct transport loads KV blocks with one-sided NIXL READs
from a peer replica's registered memory. Before blaming (or crediting) our own code
for a load's latency we need to know what the bare transfer costs: two processes,
one buffer each, registered once up front, and nothing else in the way. This script
measures exactly that, for READ (what the direct transport issues) and for WRITE (the
push direction), so the two can be compared on the same hardware.

The variants re-run the same cases under different UCX settings. The one that
matters most is ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY``: UCX 1.23 defaults it to "auto",
which on some platforms leaves cuda_ipc's get zero-copy disabled. A VRAM READ then
has no native get protocol and UCX emulates it in software (the bytes travel over
TCP), while a WRITE still rides cuda_ipc. Forcing it "on" (and, in ``no-emulation``,
forbidding the software fallback) shows what the hardware allows and whether the
fallback is what we have been measuring. Run with ``UCX_PROTO_INFO=y`` to have UCX
print, from the child processes, the protocol and transport it picks per operation
and memory type.

What is timed, in the initiator process, per (variant, op, size):

  fresh     a new transfer handle per copy, as a real load does: initialize_xfer,
            transfer, busy-poll check_xfer_state until done, release_xfer_handle
  reposted  one handle prepared once and posted again for every copy (skipped with
            a note when this NIXL version refuses to re-post a finished handle)
  local copy  the floor of the floor: ``dst[:n].copy_(src[:n])`` between two tensors
            in the initiator (with a device synchronize on CUDA)
  fresh, k descriptors  ``fresh`` with the same bytes cut into k equal descriptors
            (``--pieces k,...``): whether UCX moves the pieces of one transfer in
            parallel, i.e. whether a large load would gain from being cut up

Every case runs ``--warmup`` untimed copies, then ``--copies`` timed ones. READ cases
run first, then WRITE cases. Contents are verified after each timed loop: READs
against the target's pattern, recomputed locally; WRITEs by the target, which checks
its buffer against the initiator's pattern and restores its own before the next case.
Each transfer has a deadline (``--timeout-s``); one that expires marks the case
"timeout" and ends that variant. The parent also stops children that go silent.

Run from the repository root:

  UCX_PROTO_INFO=y python benchmark/nixl_floor.py --device cuda
  python benchmark/nixl_floor.py --device cpu [--copies 50] [--json out.json]
  python benchmark/nixl_floor.py --device cuda --variants default,no-emulation
  python benchmark/nixl_floor.py --device cuda --variants get-zcopy-on --pieces 2,4,16

The exit code is non-zero when any verification failed, any case timed out or
errored, or a child process died. Only torch, numpy, nixl and the standard library
are used; nothing from xinference.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import importlib.metadata
import json
import logging
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "get-zcopy-on": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"},
    "no-emulation": {
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on",
        "UCX_PROTO_EMULATION_ENABLE": "n",
    },
}

OPS = ("READ", "WRITE")
MIB = 1 << 20
KIB = 1 << 10

# Verdicts that make the run fail; "yes" and "skipped" do not.
BAD_VERDICTS = ("NO", "timeout", "error")


@dataclasses.dataclass(frozen=True)
class Config:
    device: str
    region_bytes: int
    sizes: tuple[int, ...]
    warmup: int
    copies: int
    timeout_s: float
    stall_s: float
    # fresh READs/WRITEs are also timed split into this many equal descriptors
    # (one per piece count above 1): whether UCX moves pieces of one transfer in
    # parallel, i.e. whether a large load gains from being cut up
    pieces: tuple[int, ...] = ()


class XferTimeout(Exception):
    """A transfer did not finish before its deadline."""


class XferFailed(Exception):
    """NIXL reported ERR for a transfer."""


# ---------------------------------------------------------------------------
# Helpers shared by both children
# ---------------------------------------------------------------------------


def torch_device(cfg: Config) -> torch.device:
    return torch.device("cuda:0" if cfg.device == "cuda" else "cpu")


def child_setup(env: dict[str, str], cfg: Config) -> None:
    """First thing in a child: the variant's environment, before nixl is imported."""
    os.environ.update(env)
    if cfg.device == "cpu":
        # One thread, like UCX's own copy; more would fight the NIXL progress
        # threads for the cores and turn the local-copy floor into scheduler noise.
        torch.set_num_threads(1)


def fence(cfg: Config) -> None:
    if cfg.device == "cuda":
        torch.cuda.synchronize()


def target_pattern(n: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int64, device=device) % 251).to(torch.uint8)


def initiator_pattern(n: int, device: torch.device) -> torch.Tensor:
    values = torch.arange(n, dtype=torch.int64, device=device) * 7 + 3
    return (values % 253).to(torch.uint8)


def make_agent(name: str) -> Any:
    # Imported here, after the variant's environment is in place: UCX reads its
    # configuration from the environment when the backend is created.
    from nixl._api import nixl_agent, nixl_agent_config

    if not os.environ.get("NIXL_LOG_LEVEL"):
        # Keep the children quiet apart from errors (and UCX's own output).
        logging.getLogger("nixl").setLevel(logging.WARNING)
    config = nixl_agent_config(
        enable_prog_thread=True, enable_listen_thread=False, backends=["UCX"]
    )
    return nixl_agent(name, config)


def as_str(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


def ucx_version() -> str | None:
    """The version of the libucp this process loaded (NIXL bundles its own)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {
                line.split()[-1]
                for line in maps
                if "libucp" in os.path.basename(line.split()[-1])
            }
        for path in sorted(paths):
            lib = ctypes.CDLL(path)
            fn = lib.ucp_get_version_string
            fn.restype = ctypes.c_char_p
            return as_str(fn())
    except (OSError, AttributeError):
        return None
    return None


def percentile_row(samples_s: list[float]) -> dict[str, Any]:
    us = np.asarray(samples_s) * 1e6
    return {
        "n": int(us.size),
        "p50_us": float(np.percentile(us, 50)),
        "p95_us": float(np.percentile(us, 95)),
        "mean_us": float(us.mean()),
        "min_us": float(us.min()),
        "max_us": float(us.max()),
        "samples_us": [round(float(v), 3) for v in us],
    }


# ---------------------------------------------------------------------------
# Target child: owns the remote buffer, answers verify/restore requests
# ---------------------------------------------------------------------------


def target_main(env: dict[str, str], cfg: Config, peer: Connection) -> None:
    child_setup(env, cfg)
    try:
        run_target(cfg, peer)
    except (EOFError, BrokenPipeError):
        pass
    except Exception as exc:
        print(f"nixl_floor target: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)


def run_target(cfg: Config, peer: Connection) -> None:
    device = torch_device(cfg)
    dev_id = device.index or 0
    mem_type = "VRAM" if cfg.device == "cuda" else "DRAM"
    own = target_pattern(cfg.region_bytes, device)
    foreign = initiator_pattern(cfg.region_bytes, device)
    buf = own.clone()
    fence(cfg)

    agent = make_agent(f"floor-target-{os.getpid()}")
    reg = agent.register_memory(
        [(buf.data_ptr(), cfg.region_bytes, dev_id, "")], mem_type=mem_type
    )
    peer.send(("hello", agent.get_agent_metadata(), buf.data_ptr(), dev_id))
    kind, meta = peer.recv()
    assert kind == "hello", kind
    agent.add_remote_agent(meta)
    peer.send(("ready",))

    while True:
        if not peer.poll(cfg.stall_s):
            break  # the initiator went away without saying so
        msg = peer.recv()
        if msg[0] == "restore":
            buf.copy_(own)
            fence(cfg)
            peer.send(("restored",))
        elif msg[0] == "verify":
            n = msg[1]
            fence(cfg)
            peer.send(("verified", bool(torch.equal(buf[:n], foreign[:n]))))
        elif msg[0] == "done":
            break
    agent.deregister_memory(reg)


# ---------------------------------------------------------------------------
# Initiator child: posts the transfers and times them
# ---------------------------------------------------------------------------


class Initiator:
    def __init__(self, cfg: Config, variant: str, peer: Connection, out: Connection):
        self.cfg = cfg
        self.variant = variant
        self.peer = peer
        self.out = out
        self.device = torch_device(cfg)
        self.dev_id = self.device.index or 0
        self.mem_type = "VRAM" if cfg.device == "cuda" else "DRAM"
        self.buf = torch.zeros(cfg.region_bytes, dtype=torch.uint8, device=self.device)
        self.expect_read = target_pattern(cfg.region_bytes, self.device)
        fence(cfg)
        # Handles that never finished; kept referenced so that their finalizers do
        # not try to cancel them in the middle of a measurement.
        self.stuck: list[Any] = []

    # -- plumbing ----------------------------------------------------------

    def ask(self, *msg: Any) -> Any:
        self.peer.send(msg)
        # Well inside the parent's stall watchdog, so that this side reports first.
        if not self.peer.poll(self.cfg.stall_s / 2):
            raise XferTimeout(f"target did not answer {msg[0]!r}")
        return self.peer.recv()

    def emit_row(
        self, op: str, mode: str, size: int, verdict: str, note: str = "", **stats: Any
    ) -> None:
        row = {
            "variant": self.variant,
            "op": op,
            "mode": mode,
            "size": size,
            "verified": verdict,
            "note": note,
        }
        row.update(stats)
        self.out.send(("row", row))

    # -- setup -------------------------------------------------------------

    def connect(self) -> None:
        self.agent = make_agent(f"floor-initiator-{os.getpid()}")
        self.reg = self.agent.register_memory(
            [(self.buf.data_ptr(), self.cfg.region_bytes, self.dev_id, "")],
            mem_type=self.mem_type,
        )
        kind, meta, self.remote_ptr, self.remote_dev = self.peer.recv()
        assert kind == "hello", kind
        self.remote = as_str(self.agent.add_remote_agent(meta))
        self.peer.send(("hello", self.agent.get_agent_metadata()))
        assert self.peer.recv()[0] == "ready"
        if hasattr(self.agent, "make_connection"):
            self.agent.make_connection(self.remote)
        self.out.send(("info", {"ucx": ucx_version(), "remote_agent": self.remote}))

    def descs(self, size: int, pieces: int = 1) -> tuple[Any, Any]:
        """``size`` bytes at the start of both buffers, as ``pieces`` equal
        descriptors (the last takes the remainder)."""
        step = size // pieces
        offsets = np.arange(pieces, dtype=np.uint64) * np.uint64(step)
        lengths = np.full(pieces, step, dtype=np.uint64)
        lengths[-1] = size - step * (pieces - 1)

        def table(base: int, device: int) -> np.ndarray:
            return np.stack(
                [
                    np.uint64(base) + offsets,
                    lengths,
                    np.full(pieces, device, np.uint64),
                ],
                axis=1,
            )

        local = self.agent.get_xfer_descs(
            table(self.buf.data_ptr(), self.dev_id), self.mem_type
        )
        remote = self.agent.get_xfer_descs(
            table(self.remote_ptr, self.remote_dev), self.mem_type
        )
        return local, remote

    # -- one transfer ------------------------------------------------------

    def post_and_wait(self, handle: Any, deadline: float) -> None:
        state = self.agent.transfer(handle)
        while state == "PROC":
            if time.perf_counter() > deadline:
                self.stuck.append(handle)
                raise XferTimeout(
                    f"transfer still in progress {self.cfg.timeout_s:g} s after it began"
                )
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise XferFailed(f"transfer state {state}")

    def fresh_copy(self, op: str, local: Any, remote: Any) -> float:
        start = time.perf_counter()
        handle = self.agent.initialize_xfer(op, local, remote, self.remote)
        try:
            self.post_and_wait(handle, start + self.cfg.timeout_s)
        except XferFailed:
            self.agent.release_xfer_handle(handle)
            raise
        self.agent.release_xfer_handle(handle)
        return time.perf_counter() - start

    def reposted_copy(self, handle: Any) -> float:
        start = time.perf_counter()
        self.post_and_wait(handle, start + self.cfg.timeout_s)
        return time.perf_counter() - start

    # -- cases -------------------------------------------------------------

    def prepare(self, op: str) -> None:
        """Reset whichever buffer the transfer writes, so that verification proves
        that this case moved the bytes."""
        if op == "READ":
            self.buf.zero_()
            fence(self.cfg)
        else:
            assert self.ask("restore")[0] == "restored"

    def verify(self, op: str, size: int) -> bool:
        if op == "READ":
            fence(self.cfg)
            return bool(torch.equal(self.buf[:size], self.expect_read[:size]))
        kind, ok = self.ask("verify", size)
        assert kind == "verified", kind
        return bool(ok)

    def run_fresh(self, op: str, size: int, pieces: int = 1) -> None:
        local, remote = self.descs(size, pieces)
        self.prepare(op)
        for _ in range(self.cfg.warmup):
            self.fresh_copy(op, local, remote)
        samples = [self.fresh_copy(op, local, remote) for _ in range(self.cfg.copies)]
        ok = self.verify(op, size)
        mode = "fresh" if pieces == 1 else f"fresh, {pieces} descriptors"
        self.emit_row(op, mode, size, "yes" if ok else "NO", **percentile_row(samples))

    def run_reposted(self, op: str, size: int) -> None:
        local, remote = self.descs(size)
        self.prepare(op)
        handle = self.agent.initialize_xfer(op, local, remote, self.remote)
        try:
            self.reposted_copy(handle)
            try:
                self.reposted_copy(handle)
            except XferTimeout:
                raise
            except Exception as exc:
                note = (
                    f"re-posting a finished handle failed: {type(exc).__name__}: {exc}"
                )
                self.emit_row(op, "reposted", size, "skipped", note)
                return
            for _ in range(max(self.cfg.warmup - 2, 0)):
                self.reposted_copy(handle)
            samples = [self.reposted_copy(handle) for _ in range(self.cfg.copies)]
        finally:
            if handle not in self.stuck:
                self.agent.release_xfer_handle(handle)
        ok = self.verify(op, size)
        self.emit_row(
            op, "reposted", size, "yes" if ok else "NO", **percentile_row(samples)
        )

    def run_local_copy(self, size: int) -> None:
        src = self.expect_read
        dst = torch.zeros(size, dtype=torch.uint8, device=self.device)
        fence(self.cfg)

        def once() -> float:
            start = time.perf_counter()
            dst[:size].copy_(src[:size])
            fence(self.cfg)
            return time.perf_counter() - start

        for _ in range(self.cfg.warmup):
            once()
        samples = [once() for _ in range(self.cfg.copies)]
        ok = bool(torch.equal(dst[:size], src[:size]))
        verdict = "yes" if ok else "NO"
        stats = percentile_row(samples)
        self.emit_row("local copy", "torch copy_", size, verdict, **stats)

    def run(self) -> bool:
        """All cases of this variant; False when the variant had to stop early."""
        for size in self.cfg.sizes:
            self.run_local_copy(size)
        for op in OPS:
            if op == "WRITE":
                self.buf.copy_(initiator_pattern(self.cfg.region_bytes, self.device))
                fence(self.cfg)
            for size in self.cfg.sizes:
                cases: list[tuple[str, Callable[[str, int], None]]] = [
                    ("fresh", self.run_fresh),
                    ("reposted", self.run_reposted),
                ]
                cases += [
                    (
                        f"fresh, {n} descriptors",
                        functools.partial(self.run_fresh, pieces=n),
                    )
                    for n in self.cfg.pieces
                    if n > 1
                ]
                for mode, case in cases:
                    try:
                        case(op, size)
                    except XferTimeout as exc:
                        self.emit_row(op, mode, size, "timeout", str(exc))
                        return False
                    except (EOFError, BrokenPipeError):
                        raise  # the target is gone; nothing else can run
                    except Exception as exc:
                        note = f"{type(exc).__name__}: {exc}"
                        self.emit_row(op, mode, size, "error", note)
        return True

    def close(self) -> None:
        self.peer.send(("done",))
        self.agent.deregister_memory(self.reg)


def initiator_main(
    env: dict[str, str],
    cfg: Config,
    variant: str,
    peer: Connection,
    out: Connection,
) -> None:
    child_setup(env, cfg)
    try:
        initiator = Initiator(cfg, variant, peer, out)
        initiator.connect()
        finished = initiator.run()
        out.send(("end", finished))
        if not finished:
            # In-flight handles may block or raise in their finalizers; leave the
            # process without running them. The parent reaps the target.
            sys.stdout.flush()
            os._exit(3)
        initiator.close()
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
        print(f"nixl_floor initiator: {message}", file=sys.stderr)
        try:
            out.send(("fatal", message))
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(2)


# ---------------------------------------------------------------------------
# Parent: starts the children per variant, prints rows as they arrive
# ---------------------------------------------------------------------------


def fmt_size(n: int) -> str:
    if n % MIB == 0:
        return f"{n // MIB} MiB"
    if n % KIB == 0:
        return f"{n // KIB} KiB"
    return f"{n} B"


def fmt_us(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.1f}" if key in row else "-"


class Report:
    HEADER = (
        "| variant | op | mode | size | p50 us | p95 us | verified |\n"
        "|---|---|---|---|---|---|---|"
    )

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.info: dict[str, Any] = {}
        self.header_done = False
        self.failed = False

    def say(self, line: str) -> None:
        print(line, flush=True)

    def row(self, row: dict[str, Any]) -> None:
        if not self.header_done:
            self.say(self.HEADER)
            self.header_done = True
        self.rows.append(row)
        cells = (
            row["variant"],
            row["op"],
            row["mode"],
            fmt_size(row["size"]),
            fmt_us(row, "p50_us"),
            fmt_us(row, "p95_us"),
            row["verified"],
        )
        self.say("| " + " | ".join(cells) + " |")
        if row["verified"] in BAD_VERDICTS:
            self.failed = True
        if row.get("note"):
            self.notes.append(
                f"{row['variant']} {row['op']} {row['mode']} "
                f"{fmt_size(row['size'])}: {row['note']}"
            )

    def note(self, variant: str, text: str, failure: bool) -> None:
        self.notes.append(f"{variant}: {text}")
        if failure:
            self.failed = True


def stop(proc: multiprocessing.process.BaseProcess, grace_s: float) -> int | None:
    proc.join(grace_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    return proc.exitcode


def run_variant(variant: str, cfg: Config, report: Report) -> None:
    ctx = multiprocessing.get_context("spawn")
    env = VARIANTS[variant]
    target_end, initiator_end = ctx.Pipe()
    result_recv, result_send = ctx.Pipe(duplex=False)
    target = ctx.Process(
        target=target_main, args=(env, cfg, target_end), name="floor-target"
    )
    initiator = ctx.Process(
        target=initiator_main,
        args=(env, cfg, variant, initiator_end, result_send),
        name="floor-initiator",
    )
    target.daemon = initiator.daemon = True
    target.start()
    initiator.start()
    # Only the children hold these now, so a dead child shows up as EOF.
    target_end.close()
    initiator_end.close()
    result_send.close()

    ended = False
    last = time.monotonic()
    while True:
        try:
            ready = result_recv.poll(1.0)
            msg = result_recv.recv() if ready else None
        except (EOFError, OSError):
            break
        if msg is None:
            if not initiator.is_alive() and not result_recv.poll(0):
                break
            if time.monotonic() - last > cfg.stall_s:
                report.note(variant, f"no progress for {cfg.stall_s:.0f} s", True)
                break
            continue
        last = time.monotonic()
        if msg[0] == "row":
            report.row(msg[1])
        elif msg[0] == "info":
            report.info.setdefault(variant, msg[1])
            if not report.header_done and msg[1].get("ucx"):
                report.say(f"ucx: {msg[1]['ucx']}")
        elif msg[0] == "fatal":
            report.note(variant, f"initiator failed: {msg[1]}", True)
        elif msg[0] == "end":
            ended = True
            if not msg[1]:
                report.note(variant, "stopped early (see timeout row)", True)
            break

    initiator_rc = stop(initiator, 20)
    target_rc = stop(target, 10)
    if not ended:
        report.note(
            variant, f"initiator ended without finishing (rc={initiator_rc})", True
        )
    elif initiator_rc not in (0, 3):
        report.note(variant, f"initiator exit code {initiator_rc}", True)
    if target_rc not in (0, None) and ended and initiator_rc == 0:
        report.note(variant, f"target exit code {target_rc}", True)
    result_recv.close()


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument(
        "--variants",
        default="default,get-zcopy-on",
        help=f"comma-separated, from: {', '.join(VARIANTS)}",
    )
    parser.add_argument("--region-mib", type=int, default=12)
    parser.add_argument("--sizes-kib", default="256,12288")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--copies", type=int, default=300)
    parser.add_argument(
        "--timeout-s", type=float, default=10.0, help="deadline per transfer"
    )
    parser.add_argument(
        "--stall-s",
        type=float,
        default=120.0,
        help="stop a variant's children after this long without progress",
    )
    parser.add_argument(
        "--pieces",
        default="",
        help="also time fresh transfers split into this many equal descriptors "
        "(comma-separated counts, e.g. 4,16)",
    )
    parser.add_argument("--json", metavar="PATH", help="write all results here")
    args = parser.parse_args(argv)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in VARIANTS]
    if unknown or not args.variant_list:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    args.sizes = tuple(int(s) * KIB for s in args.sizes_kib.split(",") if s.strip())
    region = args.region_mib * MIB
    if not args.sizes or max(args.sizes) > region or min(args.sizes) <= 0:
        parser.error(f"sizes must be positive and fit in the {args.region_mib} MiB")
    args.piece_counts = tuple(int(n) for n in args.pieces.split(",") if n.strip())
    if any(n < 1 for n in args.piece_counts):
        parser.error("--pieces counts must be >= 1")
    if args.copies < 1 or args.warmup < 0:
        parser.error("--copies must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(
        device=args.device,
        region_bytes=args.region_mib * MIB,
        sizes=args.sizes,
        warmup=args.warmup,
        copies=args.copies,
        timeout_s=args.timeout_s,
        stall_s=args.stall_s,
        pieces=args.piece_counts,
    )
    nixl_version = importlib.metadata.version("nixl")
    name = device_name(args.device)
    report = Report()
    report.say(
        f"# NIXL transfer floor: nixl {nixl_version}, torch {torch.__version__}, "
        f"{args.device} ({name}), region {args.region_mib} MiB, "
        f"{args.warmup} warmup + {args.copies} timed copies per case"
    )
    for variant in args.variant_list:
        extra = " ".join(f"{k}={v}" for k, v in VARIANTS[variant].items())
        report.say(f"variant {variant}: {extra or '(no extra environment)'}")
    inherited = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    if inherited:
        report.say(
            "inherited: " + " ".join(f"{k}={v}" for k, v in sorted(inherited.items()))
        )
    report.say("")

    started = time.monotonic()
    for variant in args.variant_list:
        run_variant(variant, cfg, report)

    report.say("")
    if report.notes:
        report.say("Notes:")
        for note in report.notes:
            report.say(f"- {note}")
    if not report.rows:
        report.failed = True
    verdict = "FAILED" if report.failed else "ok"
    report.say(f"{verdict} in {time.monotonic() - started:.1f} s")

    if args.json:
        payload = {
            "nixl": nixl_version,
            "torch": torch.__version__,
            "device": args.device,
            "device_name": name,
            "python": platform.python_version(),
            "args": {k: v for k, v in vars(args).items() if k != "variant_list"},
            "variants": {v: VARIANTS[v] for v in args.variant_list},
            "inherited_ucx_env": inherited,
            "child_info": report.info,
            "rows": report.rows,
            "notes": report.notes,
            "failed": report.failed,
            "medians_us": {
                f"{r['variant']}/{r['op']}/{r['mode']}/{r['size']}": r["p50_us"]
                for r in report.rows
                if "p50_us" in r
            },
        }
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
