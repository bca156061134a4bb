"""`submit`, `status`, `logs`, `stop` (Ray jobs on a cluster), `cluster up`/`down` (the
local autoscaling cluster) and `audit` (the records they leave: audit.py)."""

from __future__ import annotations

from raytrain_lm.errors import UserError

CLUSTER_COMMANDS = ("submit", "status", "logs", "stop", "cluster", "audit")
STOP_OUTCOMES = {
    "stopping": "stopping: the run checkpoints at its next step, then ends (resubmit to "
    "resume); `raytrain-lm stop {job}` again ends it at once, without that checkpoint",
    "forced": "ended at once: steps since the run's last checkpoint are lost",
    "already finished": "already finished",
}


def run_cluster_command(args, short_overrides: list[str]) -> int:
    if args.command == "submit":
        args.set = [*args.set, *short_overrides]
    elif short_overrides:
        raise UserError(f"`{args.command}` takes no config overrides")
    if args.command == "cluster":
        return _cluster_up_or_down(args)
    if args.command == "audit":
        return _audit(args)

    from raytrain_lm.clusters import jobs

    if args.command == "submit":
        return _submit(jobs, args)
    if args.command == "status":
        return _status(jobs, args)
    if args.command == "logs":
        return _logs(jobs, args)
    return _stop(jobs, args)


def _audit(args) -> int:
    from raytrain_lm import audit

    since = audit.since_time(args.since) if args.since else None
    records = audit.read(args.storage, args.run, since)
    for record in records:
        print(audit.line(record))
    if not records:
        print(
            f"no records under {audit.folder(args.storage)}"
            + (f" for run {args.run}" if args.run else "")
        )
    return 0


def _cluster_up_or_down(args) -> int:
    from raytrain_lm import audit
    from raytrain_lm.clusters import autoscaling

    # The local cluster's jobs keep their runs in this working directory (jobs.default_storage)
    audit.write(".", audit.new_record(f"cluster {args.cluster_command}", cluster=args.dir))
    if args.cluster_command == "up":
        tracking = None
        if not args.no_tracking:
            tracking = autoscaling.TrackingSetup(args.tracking_home, args.tracking_port)
        state = autoscaling.up(args.config, args.dir, tracking=tracking)
        print(f"local cluster up: Ray at {state['address']}, jobs at {state['dashboard']}")
        server = state["tracking"]
        if server:
            print(f"  tracking: {server['url']} (logins on; jobs log there as the admin)")
            print(f"  log in:   set -a; . {server['login']}; set +a; "
                  f"export MLFLOW_TRACKING_URI={server['url']}")  # fmt: skip
        print(
            f"  submit:   raytrain-lm submit experiments/demo.yaml --address {state['dashboard']}"
        )
        print(f"  status:   RAY_AUTH_MODE=token ray status --address {state['address']}")
        print(f"  stop:     raytrain-lm cluster down --dir {args.dir}")
        return 0
    ended = autoscaling.down(args.dir)
    print(f"local cluster down: ended {ended} processes")
    return 0


def _submit(jobs, args) -> int:
    submitted = jobs.submit(
        args.config, args.set, args.address, args.working_dir, args.storage, args.job_id
    )
    job, where = submitted["job_id"], submitted["address"]
    print(f"submitted job {job} to {where}")
    print(f"  entrypoint: {submitted['entrypoint']}")
    print(
        f"  storage:     {submitted['storage']} (relative runs and data; mlflow.db if the "
        "cluster runs no tracking server)"
    )
    print(f"  follow logs: raytrain-lm logs {job} --follow --address {where}")
    print(f"  state:       raytrain-lm status {job} --address {where}")
    print(f"  stop:        raytrain-lm stop {job} --address {where}")
    if args.follow:
        jobs.logs(job, args.address, follow=True)
        state = jobs.status(job, args.address)["status"]
        print(f"job {job}: {state}")
        return 0 if state == "SUCCEEDED" else 1
    return 0


def _status(jobs, args) -> int:
    info = jobs.status(args.job_id, args.address)
    print(
        f"{info['job_id']}: {info['status']}" + (f" ({info['message']})" if info["message"] else "")
    )
    return 0


def _logs(jobs, args) -> int:
    text = jobs.logs(args.job_id, args.address, follow=args.follow)
    if text is not None:
        print(text, end="")
    return 0


def _stop(jobs, args) -> int:
    outcome = jobs.stop(args.job_id, args.address)
    print(f"{args.job_id}: " + STOP_OUTCOMES[outcome].format(job=args.job_id))
    return 0
