"""`tracking serve` (the team's MLflow server with logins), `tracking login` (a cluster's admin
login, made before `ray up`) and `tracking user` (the admin gives a user rights on an
experiment)."""

from __future__ import annotations

import argparse
from pathlib import Path

TRACKING_COMMANDS = ("tracking",)
DEFAULT_HOME = "~/raytrain-lm/tracking"


def add_tracking_commands(commands, parser_class, positive_int) -> None:
    tracking = commands.add_parser("tracking", help="the team's MLflow server, with logins")
    sub = tracking.add_subparsers(dest="tracking_command", required=True, parser_class=parser_class)
    serve = sub.add_parser(
        "serve", help="run the MLflow server (PostgreSQL, logins) in the foreground"
    )
    serve.add_argument("--home", default=DEFAULT_HOME, help=f"its files (default {DEFAULT_HOME})")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=positive_int, default=5000)
    serve.add_argument(
        "--artifacts", help="s3://BUCKET/prefix or a folder (default HOME/artifacts)"
    )
    serve.add_argument(
        "--default-permission",
        default="READ",
        help="every user's rights on experiments they were given none on (default READ)",
    )
    serve.add_argument("--workers", type=positive_int, default=2)
    serve.add_argument(
        "--admin-login",
        help="the admin's login file, as `tracking login` writes it (default HOME/admin.env, "
        "generated at the first start)",
    )
    login = sub.add_parser(
        "login", help="write a new admin login (generated password) for a cluster's server"
    )
    login.add_argument("path", help="e.g. ~/.raytrain-lm/tracking.env (mounted on the nodes)")
    login.add_argument("--artifacts", help="where the server keeps artifacts: s3://BUCKET/mlflow")
    user = sub.add_parser(
        "user", help="give USER rights on an experiment (as the admin: its login in the env)"
    )
    user.add_argument("username")
    user.add_argument("--experiment", required=True)
    user.add_argument("--permission", choices=("READ", "USE", "EDIT", "MANAGE"), required=True)
    user.add_argument("--uri", required=True, help="the server, e.g. http://127.0.0.1:5000")
    user.add_argument(
        "--credentials-dir",
        default=".",
        help="where a new user's generated login is written, as USER.env (default .)",
    )


def run_tracking_command(args: argparse.Namespace) -> int:
    if args.tracking_command == "serve":
        from raytrain_lm.tracking.server import serve

        return serve(
            Path(args.home),
            host=args.host,
            port=args.port,
            artifacts=args.artifacts,
            default_permission=args.default_permission,
            workers=args.workers,
            admin_login=Path(args.admin_login) if args.admin_login else None,
        )
    if args.tracking_command == "login":
        from raytrain_lm.tracking.server import new_admin_login

        path = Path(args.path).expanduser()
        new_admin_login(path, args.artifacts)
        print(f"admin login written to {path} (mode 0600); `ray up` mounts it on every node")
        return 0
    from raytrain_lm.tracking.access import grant

    written = grant(
        args.uri, args.username, args.experiment, args.permission, Path(args.credentials_dir)
    )
    print(f"{args.username}: {args.permission} on experiment '{args.experiment}' at {args.uri}")
    if written is not None:
        print(f"  new user; their login is in {written} (mode 0600): hand it over privately")
    return 0
