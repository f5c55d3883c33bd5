"""``llmgw server`` and ``llmgw agent``: turn flags into configs and run the processes.

The flags are ``llmgw.cli.server``'s and ``llmgw.cli.agent``'s, which import this module
only when their command runs (it imports the whole server and agent).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

from llmgw.agent.daemon import (
    Agent,
    AgentConfig,
    AgentConfigError,
    default_state_dir,
    discover,
    parse_hostname,
    parse_labels,
    parse_servers,
    resolve_node_id,
)
from llmgw.agent.discovery import DiscoveryError
from llmgw.agent.engines import EngineError, engine_binaries
from llmgw.agent.shards import RestartPolicy
from llmgw.cli.apikeys import explain_keys, gateway_api_keys
from llmgw.cli.browsers import browser_access
from llmgw.cli.errors import CliError
from llmgw.cli.flags import engine_ports_flag, hold_config, read_token_file, tokenize_timeout
from llmgw.cli.httplimits import http_limits
from llmgw.cli.tls import listen_files
from llmgw.engineports import DEFAULT_ENGINE_PORTS
from llmgw.fdlimit import within_fd_limits
from llmgw.server.app import Listen, ServerConfig, db_target, run_server
from llmgw.server.core.tomlkeys import NAME, NAME_MAX, NAME_RULE
from llmgw.server.errors import ServerError
from llmgw.server.state.leadership import LeaseTimes
from llmgw.server.wire.grpcport import ConnectionLimits


def run_server_command(args: argparse.Namespace) -> int:
    try:
        config = ServerConfig(
            grpc_listen=Listen.parse(args.grpc_listen, "--grpc-listen"),
            http_listen=Listen.parse(args.http_listen, "--http-listen"),
            db_path=db_target(args.db),
            node_grace_s=_positive(args.node_grace, "--node-grace"),
            prune_never_ready_s=_positive(args.prune_never_ready, "--prune-never-ready"),
            heartbeat_interval_ms=int(
                _positive(args.heartbeat_interval, "--heartbeat-interval") * 1000
            ),
            max_message_bytes=int(_positive(args.max_message_bytes, "--max-message-bytes")),
            test_hooks=args.test_hooks,
            gateway_listen=_gateway_listen(args.gateway_listen),
            gateway_policy=_gateway_policy(args.gateway_policy),
            gateway_tokenize_timeout_s=tokenize_timeout(
                args.gateway_tokenize_timeout, "--gateway-tokenize-timeout"
            ),
            gateway_api_keys=gateway_api_keys(args.gateway_api_key_file, "--gateway-api-key-file"),
            gateway_hold=hold_config(
                args.gateway_hold_queue, args.gateway_hold_timeout, "gateway-"
            ),
            gateway_explain_keys=explain_keys(
                args.gateway_explain_key_file, "--gateway-explain-key-file"
            ),
            join_token=_token_file(args.join_token_file, "--join-token-file"),
            tls=listen_files(args),
            engine_ports=engine_ports_flag(args.engine_ports) or DEFAULT_ENGINE_PORTS,
            grpc_limits=_grpc_limits(args),
            browsers=browser_access(args),
            insecure_no_auth=args.insecure_no_auth,
            http_limits=http_limits(args),
            gpu_budgets=gpu_budgets(args.gpu_budget),
            autoscale_interval_s=_seconds(args.autoscale_interval, "--autoscale-interval", 600),
            autoscale_window_s=_seconds(args.autoscale_window, "--autoscale-window", 3600),
            server_id=_server_id(args.server_id),
            advertise=_advertise(args.advertise),
            lease=_lease(args.lease_ttl),
            peer_ca=args.peer_ca_file,
        )
        asyncio.run(within_fd_limits(run_server(config)))
    except ServerError as exc:
        raise CliError(str(exc)) from exc
    except OSError as exc:
        raise CliError(f"cannot serve: {exc}") from exc
    return 0


def run_agent_command(args: argparse.Namespace) -> int:
    try:
        (host, port), *more = parse_servers(args.server)
        state_dir = args.state_dir or default_state_dir()
        config = AgentConfig(
            server_host=host,
            server_port=port,
            more_servers=tuple(more),
            state_dir=state_dir,
            node_id=args.node_id,
            labels=parse_labels(args.labels),
            simulate=args.simulate,
            engine_bins=engine_binaries(args.engine_bin),
            model_dirs=tuple(args.model_dir),
            storage_paths=tuple(args.storage_path),
            restart=RestartPolicy(
                base_s=_positive(args.restart_backoff, "--restart-backoff"),
                cap_s=_positive(args.restart_backoff_max, "--restart-backoff-max"),
            ),
            startup_timeout_s=_positive(args.startup_timeout, "--startup-timeout"),
            drain_settle_s=_not_negative(args.drain_settle, "--drain-settle"),
            log_max_bytes=int(_positive(args.log_max_bytes, "--log-max-bytes")),
            log_retention_s=_finite(args.log_retention, "--log-retention"),
            token=_token_file(args.token_file, "--token-file"),
            ca_file=args.ca_file,
            join_cluster=args.join_cluster,
        )
        if args.hostname:
            config = dataclasses.replace(config, hostname=parse_hostname(args.hostname))
        if args.discover:
            node = discover(config, resolve_node_id(state_dir, args.node_id))
            sys.stdout.write(json.dumps(node.to_dict(), indent=2) + "\n")
            return 0
        asyncio.run(within_fd_limits(Agent(config).run()))
    except (AgentConfigError, DiscoveryError, EngineError) as exc:
        raise CliError(str(exc)) from exc
    return 0


def _server_id(text: str | None) -> str | None:
    if text is None:
        return None
    if not text or len(text) > 200 or not text.isprintable() or any(c.isspace() for c in text):
        raise CliError(f"--server-id {text!r}: 1 to 200 printable characters without spaces")
    return text


def _advertise(text: str | None) -> str | None:
    if text is None:
        return None
    listen = Listen.parse(text, "--advertise")
    if listen.port == 0:
        raise CliError(f"--advertise {text!r}: a port agents can dial (not 0)")
    return str(listen)


def _lease(ttl: float) -> LeaseTimes:
    seconds = _seconds(ttl, "--lease-ttl", 60)
    try:
        return LeaseTimes(ttl_s=seconds)
    except ValueError as exc:
        raise CliError(f"--lease-ttl {ttl}: {exc}") from None


MAX_GPU_BUDGET = 1_000_000


def gpu_budgets(values: list[str]) -> dict[str, int]:
    """``--gpu-budget POOL=N`` (repeated) as ``{POOL: N}``; a bad value names the flag."""
    budgets: dict[str, int] = {}
    for value in values:
        pool, equals, count = value.partition("=")
        if not equals or not NAME.fullmatch(pool) or len(pool) > NAME_MAX:
            why = f"POOL=N, POOL a pool name ({NAME_RULE})"
            raise CliError(f"--gpu-budget {value!r} is not {why}")
        if not (count.isascii() and count.isdigit()) or not 1 <= int(count) <= MAX_GPU_BUDGET:
            why = f"N must be a whole number of GPUs from 1 to {MAX_GPU_BUDGET:,}"
            raise CliError(f"--gpu-budget {value!r}: {why}")
        if pool in budgets:
            raise CliError(f"--gpu-budget gives pool {pool} twice ({budgets[pool]} and {count})")
        budgets[pool] = int(count)
    return budgets


def _grpc_limits(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(
        handshake_timeout_s=_finite(args.grpc_handshake_timeout, "--grpc-handshake-timeout"),
        idle_timeout_s=_finite(args.grpc_idle_timeout, "--grpc-idle-timeout"),
        max_connections=int(_positive(args.grpc_max_connections, "--grpc-max-connections")),
        max_per_peer=int(
            _positive(args.grpc_max_connections_per_peer, "--grpc-max-connections-per-peer")
        ),
    )


def _finite(value: float, flag: str) -> float:
    if not 0 < value < float("inf"):  # NaN too
        raise CliError(f"{flag} must be a positive number of seconds, not {value}")
    return value


def _token_file(path: Path | None, flag: str) -> str | None:
    return None if path is None else read_token_file(path, flag)


def _gateway_listen(text: str) -> Listen | None:
    return None if text == "off" else Listen.parse(text, "--gateway-listen")


def _gateway_policy(name: str) -> str:
    from llmgw.gateway.routing.policy import POLICIES

    if name not in POLICIES:
        raise CliError(f"--gateway-policy {name!r} is not one of {', '.join(POLICIES)}")
    return name


def _not_negative(value: float, flag: str) -> float:
    if value < 0:
        raise CliError(f"{flag} must not be negative, not {value}")
    return value


def _positive(value: float, flag: str) -> float:
    if value <= 0:
        raise CliError(f"{flag} must be positive, not {value}")
    return value


def _seconds(value: float, flag: str, most: float) -> float:
    """A positive number of seconds, at most ``most``; else a CliError naming the flag."""
    if not 0 < value <= most:  # NaN fails both
        raise CliError(f"{flag} must be more than 0 and at most {most:g} seconds, not {value:g}")
    return value
