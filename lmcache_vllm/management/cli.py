"""`lmcache-vllm coordinator` (runs the fleet coordinator) and `lmcache-vllm cache ...` (steers a fleet through it).

    lmcache-vllm coordinator --port 9300 --redis-url redis://host:6379/0 --token-file /etc/lmcache/token
    lmcache-vllm cache lookup   --coordinator http://host:9300 --model MODEL (--prompt TEXT | --token-ids 1,2,3)
    lmcache-vllm cache pin|unpin  ... [--salt S]
    lmcache-vllm cache delete   ... --instance ID [--tier all|l1|l2] [--force]
    lmcache-vllm cache prefetch ... --instance ID [--wait]
    lmcache-vllm cache move     ... --instance SOURCE --to TARGET [--keep-source] [--wait]

A prompt given as text is tokenized with the model's tokenizer (`--tokenizer`, default `--model`) as vLLM's
completions endpoint does (special tokens added); `--token-ids` / `--token-ids-file` take ids as they are. Every
command prints a table, or with `--json` the coordinator's answer. Writes need `--token-file` (reads from loopback
do not). Exit codes: 0 done, 1 the coordinator refused or could not be reached (its answer on stderr), 2 usage.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional, Sequence

from lmcache_vllm.management.client import request

CACHE_COMMANDS = ("lookup", "pin", "unpin", "delete", "prefetch", "move")


# ------------------------------------------------------------------ the coordinator process
def coordinator_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-vllm coordinator", description="The fleet coordinator "
                                     "(LMCache's MP-coordinator API; docs/MANAGEMENT.md).")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=9300)
    parser.add_argument("--redis-url", required=True, help="the Redis of the fleet's P2P directory (any remote_url "
                                                           "form: redis://, redis-cluster://, redis-sentinel://)")
    parser.add_argument("--token-file", required=True, help="file holding the fleet's bearer token")
    parser.add_argument("--prefix", default=None, help="Redis key prefix (default extra_config.remote_key_prefix's); "
                                                       "the coordinator's keys go under <prefix>coord:")
    parser.add_argument("--instance-timeout", type=float, default=30.0,
                        help="seconds without a heartbeat after which an instance is dropped")
    parser.add_argument("--move-poll-interval", type=float, default=0.5)
    parser.add_argument("--move-timeout", type=float, default=600.0)
    parser.add_argument("--move-result-ttl", type=float, default=600.0, help="seconds a move's result is kept")
    parser.add_argument("--call-timeout", type=float, default=10.0, help="seconds per call to an instance")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    import asyncio
    import logging

    from aiohttp import web

    from lmcache_vllm.config.extra import ExtraConfig
    from lmcache_vllm.config.redact import redact_text, remember_url_secrets
    from lmcache_vllm.config.remote_url import parse_remote_url
    from lmcache_vllm.management.auth import read_token
    from lmcache_vllm.management.coordinator import Coordinator
    from lmcache_vllm.management.fleet import FleetClient, FleetStore
    from lmcache_vllm.storage.redis.client import ClientSettings, async_client

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    remember_url_secrets(args.redis_url)
    try:
        token = read_token(args.token_file)
        target = parse_remote_url(args.redis_url)
    except ValueError as exc:
        print(f"lmcache-vllm coordinator: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    prefix = args.prefix if args.prefix is not None else ExtraConfig().remote_key_prefix

    async def serve() -> None:
        client = async_client(target, ClientSettings(timeout=5.0))
        try:
            await client.ping()
        except Exception as exc:
            raise RuntimeError(f"the Redis at {target.display()} does not answer: "
                               f"{type(exc).__name__}: {exc}") from None
        store = FleetStore(client, prefix, lease_s=args.instance_timeout, move_ttl_s=args.move_result_ttl)
        coordinator = Coordinator(store, FleetClient(token, args.call_timeout), token,
                                  move_poll_s=args.move_poll_interval, move_timeout_s=args.move_timeout)
        runner = web.AppRunner(coordinator.app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port, reuse_address=True).start()
        print(f"lmcache-vllm coordinator on http://{args.host}:{args.port}, state in {target.display()} "
              f"under {prefix}coord:", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
            await client.aclose()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        return 0
    except Exception as exc:
        print(f"lmcache-vllm coordinator: {redact_text(str(exc))}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------ lmcache-vllm cache ...
def _cache_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcache-vllm cache", description="Steer a fleet's cache through its "
                                     "coordinator (docs/MANAGEMENT.md).")
    parser.add_argument("command", choices=CACHE_COMMANDS)
    parser.add_argument("--coordinator", required=True, help="http://host:port of the coordinator")
    parser.add_argument("--token-file", default=None, help="the fleet's bearer token (writes need it)")
    parser.add_argument("--model", required=True, help="the model name the instances serve (vLLM's served name)")
    parser.add_argument("--world-size", type=int, default=1, help="the instances' tensor_parallel_size")
    parser.add_argument("--salt", default="", help="cache_salt of the requests")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="the prompt as text (tokenized with --tokenizer)")
    what.add_argument("--token-ids", help="the prompt's token ids, comma-separated")
    what.add_argument("--token-ids-file", help="a file holding the token ids (JSON list, or comma/space separated)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer of --prompt (default: --model)")
    parser.add_argument("--instance", default=None, help="the instance (delete, prefetch; move: the source)")
    parser.add_argument("--to", default=None, help="move: the target instance")
    parser.add_argument("--tier", default="all", choices=("l1", "l2", "all"), help="delete: which tiers")
    parser.add_argument("--force", action="store_true", help="delete: also what pins and loads hold")
    parser.add_argument("--keep-source", action="store_true", help="move: copy, do not delete at the source")
    parser.add_argument("--wait", action="store_true", help="prefetch, move: wait until it is over")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per call (and --wait's longest wait)")
    parser.add_argument("--json", action="store_true", help="print the coordinator's JSON answer")
    return parser


def _token_ids(args: argparse.Namespace) -> list[int]:
    if args.prompt is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        return [int(t) for t in tokenizer.encode(args.prompt)]
    text = args.token_ids if args.token_ids is not None else open(args.token_ids_file).read()
    text = text.strip()
    values = json.loads(text) if text.startswith("[") else text.replace(",", " ").split()
    return [int(v) for v in values]


class CliError(Exception):
    pass


def _call(args: argparse.Namespace, token: Optional[bytes], method: str, path: str,
          body: Optional[dict[str, Any]] = None) -> Any:
    try:
        status, got = request(args.coordinator.rstrip("/") + path, method, token, body, args.timeout)
    except OSError as exc:
        raise CliError(f"the coordinator {args.coordinator} cannot be reached: {exc}") from None
    if status >= 300:
        detail = got.get("detail") if isinstance(got, dict) else got
        raise CliError(f"the coordinator answered {status}: {json.dumps(detail)}")
    return got


def _wait(args: argparse.Namespace, token: Optional[bytes], path: str, done: Sequence[str]) -> Any:
    deadline = time.monotonic() + args.timeout
    while True:
        got = _call(args, token, "GET", path)
        if got.get("status") in done or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def run_cache(args: argparse.Namespace) -> Any:
    """The coordinator's answer to one `lmcache-vllm cache` command."""
    from lmcache_vllm.management.auth import read_token

    token = read_token(args.token_file) if args.token_file else None
    form = {"model_name": args.model, "world_size": args.world_size, "token_ids": _token_ids(args),
            "cache_salt": args.salt}
    if args.command == "lookup":
        return _call(args, token, "POST", "/directory/lookup", form)
    if args.command in ("pin", "unpin"):
        return _call(args, token, "POST" if args.command == "pin" else "DELETE", "/cache/pins", form)
    if args.instance is None:
        raise CliError(f"{args.command} needs --instance")
    if args.command == "delete":
        return _call(args, token, "POST", "/cache/delete",
                     dict(form, instance_id=args.instance, tier=args.tier, force=args.force))
    if args.command == "prefetch":
        got = _call(args, token, "POST", "/cache/prefetches", dict(form, instance_id=args.instance))
        if args.wait and got.get("status") == "submitted":
            return _wait(args, token, f"/cache/prefetches/{args.instance}/{got['request_id']}", ("completed",))
        return got
    if args.to is None:
        raise CliError("move needs --to")
    got = _call(args, token, "POST", "/cache/moves", dict(form, source_instance_id=args.instance,
                                                           target_instance_id=args.to, keep_source=args.keep_source))
    if args.wait and got.get("status") == "submitted":
        return _wait(args, token, f"/cache/moves/{got['move_id']}", ("completed", "failed"))
    return got


def format_answer(command: str, got: Any) -> str:
    if command != "lookup":
        return "\n".join(f"{k:<20} {json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in got.items())
    lines = [f"{'chunk':>5}  {'rank':>4}  {'tokens':>11}  {'key':<34}  where"]
    cs = max((len(r.get("token_ids", [])) for r in got["results"]), default=0)
    for i, result in enumerate(got["results"]):
        key = result["key"]
        rank = (key["kv_rank"] >> 16) & 0xFF
        ws = max(1, key["kv_rank"] >> 24)
        chunk = i // ws
        where = ", ".join(f"{p['instance_id']}:{p['tier']}/{p['backend']}" for p in result["placements"]) or "-"
        span = f"{chunk * cs}-{chunk * cs + len(result.get('token_ids', []))}" if cs else "-"
        lines.append(f"{chunk:>5}  {rank:>4}  {span:>11}  {key['chunk_hash_hex'][:32]:<34}  {where}")
    lines.append(f"{got['chunks']} chunk(s)")
    return "\n".join(lines)


def cache_main(argv: Sequence[str]) -> int:
    try:
        args = _cache_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        got = run_cache(args)
    except (CliError, ValueError, OSError) as exc:
        print(f"lmcache-vllm cache {args.command}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(got, indent=1) if args.json else format_answer(args.command, got))
    return 1 if isinstance(got, dict) and got.get("status") == "failed" else 0
