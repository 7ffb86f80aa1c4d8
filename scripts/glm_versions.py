#!/usr/bin/env python3
"""Roll out numbered versions of the glm model on a running server (docs/versions.md):

    scripts/glm_versions.py status
    scripts/glm_versions.py deploy 2 --model-dir /srv/checkpoints/glm-v2 [--set kv_cache_memory_mb=1024]
    scripts/glm_versions.py canary 2 --percent 20
    scripts/glm_versions.py promote 2
    scripts/glm_versions.py rollback

Run it where the model repository is; the control-plane key comes from GLM_ADMIN_KEY (or --admin-key). The Python
API is clients.versions.VersionManager (glm_tools/versions.py). Exit status 0 on success, 1 when a step failed (the
message says why).
"""

import argparse
import os
import sys

from glm_tools.versions import VersionError, VersionManager

REPOSITORY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_repository")


def engine_setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8000", help="the server's HTTP endpoint (default localhost:8000)")
    parser.add_argument("--metrics-url", help="host:port of its metrics (default: the url's host, port 8002)")
    parser.add_argument("--model-repository", default=os.environ.get("GLM_MODEL_REPOSITORY", REPOSITORY),
                        help="the folder the server serves (default GLM_MODEL_REPOSITORY, else this repository's)")
    parser.add_argument("--admin-key", default=os.environ.get("GLM_ADMIN_KEY"),
                        help="the control-plane key (default GLM_ADMIN_KEY)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("status", help="the versions, their state, share of traffic, KV use and requests served")
    deploy = commands.add_parser("deploy", help="load a new version beside the serving one, warm it up, probe it")
    deploy.add_argument("version", type=int)
    deploy.add_argument("--model-dir", required=True, help="the version's checkpoint")
    deploy.add_argument("--set", type=engine_setting, action="append", default=[], metavar="KEY=VALUE",
                        help="an engine parameter for this version only (any of config.pbtxt's), e.g. "
                             "kv_cache_memory_mb=1024; repeatable")
    canary = commands.add_parser("canary", help="send a share of requests to a deployed version")
    canary.add_argument("version", type=int)
    canary.add_argument("--percent", type=float, required=True)
    promote = commands.add_parser("promote", help="all requests to a version; unload the others once they are done")
    promote.add_argument("version", type=int)
    commands.add_parser("rollback", help="back to the stable version (during a canary) or the previous one")
    args = parser.parse_args(argv)

    try:
        manager = VersionManager(args.url, args.model_repository, admin_key=args.admin_key,
                                 metrics_url=args.metrics_url)
        if args.command == "status":
            print_status(manager)
        elif args.command == "deploy":
            manager.deploy(args.version, args.model_dir, dict(args.set))
        elif args.command == "canary":
            manager.canary(args.version, args.percent)
        elif args.command == "promote":
            manager.promote(args.version)
        else:
            manager.rollback()
    except VersionError as exc:
        print(f"glm_versions {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


def print_status(manager: VersionManager) -> None:
    def number(value) -> str:
        return "-" if value is None else f"{value:g}"

    print(f"{'version':>7}  {'state':<11} {'share':>6}  {'KV blocks':>13}  {'in flight':>9}  {'served':>7}  checkpoint")
    for row in manager.status():
        kv = f"{number(row.kv_blocks_used)}/{number(row.kv_blocks_total)}"
        print(f"{row.version:>7}  {row.state:<11} {row.share:>5g}%  {kv:>13}  {number(row.requests_running):>9}  "
              f"{number(row.requests_served):>7}  {row.checkpoint}")


if __name__ == "__main__":
    sys.exit(main())
