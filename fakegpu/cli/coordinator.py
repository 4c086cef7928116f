"""`python -m fakegpu coordinator`: run a coordinator, or ping / shut down a running one.

    python -m fakegpu coordinator --transport unix --address /tmp/fgpu/c.sock
    python -m fakegpu coordinator --listen 127.0.0.1:29591 --token-file tok --report r.json
    python -m fakegpu coordinator --ping /tmp/fgpu/c.sock
    python -m fakegpu coordinator --shutdown 127.0.0.1:29591 --token-file tok

Unset flags fall back to the FAKEGPU_* environment (docs/usage.md). When ready it prints
one line, "fakegpu coordinator listening on ADDR", and flushes stdout.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Optional

from fakegpu.env import ConfigError, load_env, parse_int, parse_size, read_token_file


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fakegpu coordinator",
                                description="Run the fakegpu coordinator, or ping / shut down a running one.")
    where = p.add_argument_group("where to listen")
    where.add_argument("--transport", choices=("unix", "tcp"),
                       help="unix (default) or tcp (FAKEGPU_COORDINATOR_TRANSPORT)")
    where.add_argument("--address", metavar="ADDR",
                       help="socket path for unix, HOST:PORT for tcp (FAKEGPU_COORDINATOR_ADDR)")
    where.add_argument("--listen", metavar="HOST:PORT", help="listen on TCP (same as --transport tcp --address)")
    p.add_argument("--cluster-config", metavar="YAML", help="cluster topology (FAKEGPU_CLUSTER_CONFIG)")
    p.add_argument("--report", metavar="PATH", help="JSON cluster report (FAKEGPU_CLUSTER_REPORT_PATH)")
    p.add_argument("--markdown-report", metavar="PATH",
                   help="Markdown report (FAKEGPU_CLUSTER_REPORT_MARKDOWN_PATH; default beside the JSON)")
    p.add_argument("--trace", metavar="PATH", help="Perfetto/Chrome trace (FAKEGPU_TRACE_PATH)")
    p.add_argument("--max-operations", metavar="N",
                   help="timeline entries kept in the report (FAKEGPU_CLUSTER_REPORT_MAX_OPERATIONS)")
    p.add_argument("--report-interval", metavar="SECONDS", type=float,
                   help="also write the reports every SECONDS while running")
    p.add_argument("--timeout-ms", metavar="MS",
                   help="rendezvous/operation timeout (FAKEGPU_COORDINATOR_TIMEOUT_MS, default 600000)")
    p.add_argument("--local-slot-bytes", metavar="SIZE",
                   help="slot size of host-local collective arenas (FAKEGPU_LOCAL_SLOT_BYTES; default "
                        "min(1 MiB, 128 MiB / (nranks + 1)))")
    p.add_argument("--hello-timeout-ms", metavar="MS",
                   help="close a connection that has not completed HELLO within MS "
                        "(FAKEGPU_COORDINATOR_HELLO_TIMEOUT_MS, default 10000)")
    p.add_argument("--max-unauthenticated", metavar="N",
                   help="connections open at once without a completed HELLO; a new one beyond N closes the "
                        "oldest (FAKEGPU_COORDINATOR_MAX_UNAUTHENTICATED, default 256)")
    p.add_argument("--max-staging-bytes", metavar="SIZE", default="256MiB",
                   help="largest staging region granted to a client (default 256MiB)")
    auth = p.add_mutually_exclusive_group()
    auth.add_argument("--token", help="shared secret clients must present (FAKEGPU_COORDINATOR_TOKEN)")
    auth.add_argument("--token-file", metavar="PATH",
                      help="file holding the token (FAKEGPU_COORDINATOR_TOKEN_FILE)")
    admin = p.add_mutually_exclusive_group()
    admin.add_argument("--ping", metavar="ADDR",
                       help="ask the coordinator at ADDR for its status and exit (with its token, if it has one)")
    admin.add_argument("--shutdown", metavar="ADDR",
                       help="make the coordinator at ADDR write its reports and exit")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    return p


def _token(ns, env) -> str:
    if ns.token is not None:
        return ns.token
    if ns.token_file is not None:
        return read_token_file(ns.token_file, "--token-file")
    return env.coordinator_token


def _admin(ns, env) -> int:
    from fakegpu import protocol as P
    from fakegpu.coordinator.client import ClientError, SyncClient

    address = ns.ping or ns.shutdown
    try:
        with SyncClient(address, ns.transport, timeout_s=10.0) as client:
            if ns.ping:
                reply = client.request(P.Ping(_token(ns, env)))
                if isinstance(reply, P.Pong):
                    print(reply.description, flush=True)
                    return 0
            else:
                reply = client.request(P.Shutdown(_token(ns, env)))
                if isinstance(reply, P.Ok):
                    print(f"fakegpu coordinator at {address} is shutting down", flush=True)
                    return 0
    except (ClientError, ConfigError, OSError) as exc:
        print(f"fakegpu coordinator: {exc}", file=sys.stderr)
        return 1
    message = getattr(reply, "message", repr(reply))
    print(f"fakegpu coordinator: {address} answered: {message}", file=sys.stderr)
    return 1


def main(argv: Optional[list] = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(ns.log_level).upper(), logging.WARNING),
                        format="fakegpu coordinator: %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        env = load_env()
        if ns.ping or ns.shutdown:
            return _admin(ns, env)
        return _serve(ns, env)
    except ConfigError as exc:
        print(f"fakegpu coordinator: {exc}", file=sys.stderr)
        return 2


def _option_or_env(value: Optional[str], option: str, var: str, default: int) -> int:
    """A positive integer from the option, else the environment variable, else the default."""
    if value:
        return parse_int(value, option, minimum=1)
    text = os.environ.get(var, "").strip()
    return parse_int(text, var, minimum=1) if text else default


def _serve(ns, env) -> int:
    from fakegpu import _deps

    cluster_config = ns.cluster_config or env.cluster_config
    _deps.check(_deps.COORDINATOR + (_deps.CLUSTER_CONFIG if cluster_config else ()),
                "the coordinator" + (" with a cluster config" if cluster_config else ""))
    from fakegpu.coordinator import reporting
    from fakegpu.coordinator.core import Core
    from fakegpu.coordinator.server import (DEFAULT_HELLO_TIMEOUT_S, DEFAULT_MAX_UNAUTHENTICATED, ServerError,
                                            run_server)

    if ns.listen:
        if ns.transport == "unix":
            raise ConfigError("--listen is for TCP; it cannot be combined with --transport unix")
        if ns.address:
            raise ConfigError("give either --listen HOST:PORT or --address, not both")
        transport, address = "tcp", ns.listen
    else:
        transport = ns.transport or env.coordinator_transport
        address = ns.address or env.coordinator_addr
    if not address:
        raise ConfigError("no address: pass --address PATH (unix), --listen HOST:PORT (tcp), "
                          "or set FAKEGPU_COORDINATOR_ADDR")
    timeout_ms = parse_int(ns.timeout_ms, "--timeout-ms", minimum=1) if ns.timeout_ms else env.coordinator_timeout_ms
    hello_timeout_ms = _option_or_env(ns.hello_timeout_ms, "--hello-timeout-ms",
                                      "FAKEGPU_COORDINATOR_HELLO_TIMEOUT_MS", int(DEFAULT_HELLO_TIMEOUT_S * 1000))
    max_unauthenticated = _option_or_env(ns.max_unauthenticated, "--max-unauthenticated",
                                         "FAKEGPU_COORDINATOR_MAX_UNAUTHENTICATED", DEFAULT_MAX_UNAUTHENTICATED)
    max_ops = parse_int(ns.max_operations, "--max-operations", minimum=0) if ns.max_operations \
        else env.cluster_report_max_operations
    if ns.report_interval is not None and ns.report_interval <= 0:
        raise ConfigError(f"--report-interval {ns.report_interval} must be positive")
    token = _token(ns, env)
    report_path = ns.report or env.cluster_report_path
    markdown_path = ns.markdown_report or env.cluster_report_markdown_path
    trace_path = ns.trace or env.trace_path
    if report_path:
        _check_report_paths(report_path, markdown_path, trace_path)
    try:
        topology = reporting.load_topology(cluster_config)
    except ImportError as exc:
        logging.getLogger("fakegpu.coordinator").warning(
            "topology layer unavailable (%s); ignoring --cluster-config", exc)
        topology = None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--cluster-config {cluster_config}: {exc}") from None
    # Plausible-but-suspicious inputs (a units slip, typically) are said at start, where the
    # person who wrote the YAML sees them, and kept in the report's notes as well.
    for warning in getattr(topology, "warnings", None) or []:
        print(f"fakegpu coordinator: warning: {warning}", file=sys.stderr, flush=True)

    # inf - inf, 0 * inf, integer-like overflow in floats: results NCCL produces silently.
    import numpy as np
    np.seterr(all="ignore")
    core_box: list = []

    def world_hint() -> int:
        if not core_box:
            return 0
        return max([c.hello.world_size for c in core_box[0].clients.values()] or [0])

    recorder = reporting.make_recorder(
        topology, report_path=report_path, max_operations=max_ops,
        metadata=reporting.metadata(transport, address, cluster_config), world_size_hint=world_hint)
    core = Core(token=token, timeout_ms=timeout_ms, recorder=recorder, transport=transport,
                max_staging_bytes=parse_size(ns.max_staging_bytes, "--max-staging-bytes"),
                cost_fn=reporting.make_cost_fn(topology), topology=topology, defer_records=True,
                local_slot_bytes=parse_size(ns.local_slot_bytes, "--local-slot-bytes") if ns.local_slot_bytes else None)
    core_box.append(core)
    log = logging.getLogger("fakegpu.coordinator")

    def write_reports(why: str) -> bool:
        """Write the reports; False (and an error logged) when that failed."""
        if not report_path or not hasattr(recorder, "write"):
            return True
        core.flush_records()
        try:
            recorder.write(report_path, markdown_path, trace_path)
            log.info("reports written (%s) to %s", why, report_path)
        except Exception as exc:
            log.error("writing the reports (%s) failed: %s", why, exc)
            return False
        return True

    def on_listening(addr: str) -> None:
        print(f"fakegpu coordinator listening on {addr}", flush=True)

    try:
        reason = asyncio.run(run_server(core, transport=transport, address=address, on_listening=on_listening,
                                        write_reports=write_reports, report_interval_s=ns.report_interval,
                                        hello_timeout_s=hello_timeout_ms / 1000.0,
                                        max_unauthenticated=max_unauthenticated))
    except ServerError as exc:
        print(f"fakegpu coordinator: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C while stopping
        reason = "interrupted"
    written = write_reports(reason)
    unused = getattr(getattr(recorder, "report", None), "unused_ranks_warning", lambda: None)()
    if unused:
        log.warning("%s", unused)
    local = (f"; {core.n_local_ops} of {core.n_ops} calls ran host-local in {core.n_arenas} arena(s)"
             if core.n_arenas else "")
    print(f"fakegpu coordinator stopped: {reason}{local}", file=sys.stderr, flush=True)
    if not written:
        # A job whose report was lost must not look like a success (fgpu relies on this status).
        print(f"fakegpu coordinator: error: the final reports could not be written to {report_path}",
              file=sys.stderr, flush=True)
        return 1
    return 0


def _check_report_paths(report_path: str, markdown_path: Optional[str], trace_path: Optional[str]) -> None:
    """Before serving anyone: every report path can be written (else a whole job runs for nothing)."""
    from fakegpu.report.writer import ReportPathError, check_writable, default_markdown_path

    for flag, path in (("--report", report_path),
                       ("--markdown-report", markdown_path or default_markdown_path(report_path)),
                       ("--trace", trace_path)):
        if path:
            try:
                check_writable(path)
            except ReportPathError as exc:
                raise ConfigError(f"cannot write the report {flag} {path}: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
