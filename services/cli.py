"""The `tessera` command: run a role, build the demo assets and tasks, launch everything, inspect config.

Heavy imports (torch, flask, sqlalchemy, grpc) happen inside the subcommands, so
`tessera --help` and `tessera health` start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.config import ConfigError, TesseraConfig, load_config
from services.common.private_home import make_home_private

if TYPE_CHECKING:
    from registry.store import RegistryStore
    from services.demo_assets import DemoAssets

# role -> module whose `serve(config)` runs it
ROLE_MODULES = {
    "registry": "registry.server",
    "gateway": "gateway.server",
    "worker": "gpu_worker.server",
    "cpu-lora": "cpu_lora_worker.sidecar",  # a worker's CPU LoRA workers from a sidecar container
}
GRPC_ROLES = ("gateway", "registry", "worker")  # those serving the gRPC health service

READ_ONLY_COMMANDS = frozenset({"config", "health"})  # the others write under TESSERA_HOME

class DemoRegistrationError(RuntimeError):
    """A demo name is already taken by different content; registering would silently change it."""


def register_demo_assets(store: RegistryStore, assets: DemoAssets, progress: Callable[[str], None] = print) -> None:
    """Register one built demo model and its adapters (idempotent: same content is left alone)."""
    from services.common.adapter_layout import directory_digest
    from services.common.errors import NotFound

    try:
        base = store.get_base_model(assets.name)
        progress(f"base model {assets.name}: already registered (path {base.path})")
    except NotFound:
        base = store.register_base_model(assets.name, str(assets.base_dir))
        progress(f"base model {assets.name}: registered (path {base.path})")
    for name, source_dir in assets.adapter_dirs.items():
        sha256 = directory_digest(source_dir)  # what the registry records (common.proto, Adapter.sha256)
        try:
            existing = store.get_adapter(name)
        except NotFound:
            record = store.register_adapter(name, assets.name, str(source_dir))
            progress(f"adapter {name}: registered (rank {record.rank}, sha256 {record.sha256[:12]})")
            continue
        if existing.sha256 != sha256:
            raise DemoRegistrationError(
                f"adapter {name} is already registered with sha256 {existing.sha256[:12]}, but the demo "
                f"build at {source_dir} has {sha256[:12]}; delete the adapter through the admin API first")
        progress(f"adapter {name}: already registered (sha256 {sha256[:12]})")


def _serve(config: TesseraConfig, args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.launcher.plan import LaunchError, check_ports_free, served_role_spec

    setup_logging(args.role, config.log_level)
    try:
        spec = served_role_spec(config, args.role)
        check_ports_free([spec] if spec else [])  # a taken port: named with its key, before anything loads
        importlib.import_module(ROLE_MODULES[args.role]).serve(config)
    except (ConfigError, LaunchError) as exc:  # a missing certificate, say: one clear line, not a traceback
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    return 0


def _demo_assets(config: TesseraConfig, args: argparse.Namespace) -> int:
    from registry.store import RegistryStore
    from services.demo_assets import build_demo_assets

    built = build_demo_assets(config.models_path, progress=print)
    store = RegistryStore.from_config(config)
    try:
        for assets in built:
            register_demo_assets(store, assets)
    except DemoRegistrationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    return 0


def _demo_tasks(config: TesseraConfig, args: argparse.Namespace) -> int:
    from services.demo_tasks import build_demo_tasks

    out_dir = args.out if args.out is not None else config.home_path / "tasks"
    path = build_demo_tasks(out_dir.expanduser().resolve(), seed=args.seed, train_per_task=args.train,
                            eval_per_task=args.eval)
    print(f"manifest: {path}")
    return 0


def _base_model_dir(config: TesseraConfig, name: str) -> Path | None:
    """A base model's checkpoint: the registry's record of it, else the demo models' directory."""
    from registry.store import RegistryStore
    from services.common.errors import NotFound

    store = RegistryStore.from_config(config)
    try:
        return Path(store.get_base_model(name).path)
    except NotFound:
        fallback = config.models_path / name
        return fallback if (fallback / "config.json").is_file() else None
    finally:
        store.close()


def _fuse(config: TesseraConfig, args: argparse.Namespace) -> int:
    import torch

    from services.fuse.data import FuseDataError, load_examples
    from services.fuse.evaluate import EngineEvaluator
    from services.fuse.manifest import ManifestError, load_manifest
    from services.fuse.run import FusedRegistrationError, register_fused, run_fuse
    from services.fuse.trainer import PeftTrainer

    try:
        manifest = load_manifest(args.manifest)
        for task in manifest.tasks:  # every file checked before any training: a bad line fails the run at once
            load_examples(task.train, task)
            load_examples(task.eval, task)
    except (ManifestError, FuseDataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    base_dir = _base_model_dir(config, manifest.base_model)
    if base_dir is None:
        print(f"error: {args.manifest}: base model {manifest.base_model!r} is neither registered nor under "
              f"{config.models_path} (run `tessera demo-assets` for the demo models)", file=sys.stderr)
        return 2
    stem = Path(args.manifest).stem
    run_dir = (args.run_dir or config.home_path / "fuse" / stem).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"run directory: {run_dir}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    evaluator = EngineEvaluator(manifest.base_model, base_dir, run_dir, manifest.training.rank, device)
    try:
        report = run_fuse(manifest, PeftTrainer(base_dir, manifest, run_dir, evaluator, device), run_dir)
    finally:
        evaluator.close()
    if args.register:
        from registry.store import RegistryStore

        store = RegistryStore.from_config(config)
        try:
            register_fused(store, report, run_dir, config.import_root_paths[0], stem)
        except FusedRegistrationError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        finally:
            store.close()
    print(f"report: {run_dir / 'report.md'}")
    return 0


def _up(config: TesseraConfig, args: argparse.Namespace) -> int:
    from services.launcher.plan import serve_command
    from services.launcher.supervisor import launch
    from services.common.logs import setup_logging

    setup_logging("launcher", config.log_level)
    if args.workers is not None:
        config.launcher.workers = args.workers
    return launch(config, serve_command(args.config))


def _config(config: TesseraConfig, args: argparse.Namespace) -> int:
    import yaml

    print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
    return 0


def _certs(config: TesseraConfig, args: argparse.Namespace) -> int:
    from services.common.tls import TlsError
    from services.common.tls_issue import ensure_cluster_certs

    try:
        for line in ensure_cluster_certs(config, force=args.force):
            print(line)
    except TlsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _health(config: TesseraConfig, args: argparse.Namespace) -> int:
    from services.common.grpc_server import health_status
    from services.common.tls import TlsError, health_probe_credentials

    try:
        credentials = health_probe_credentials(config, args.role)
    except TlsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    status = health_status(args.address, timeout_s=args.timeout, credentials=credentials)
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


def build_parser() -> argparse.ArgumentParser:
    # --config is accepted before or after the subcommand: `tessera --config c.yaml up` and
    # `tessera up --config c.yaml` (what scripts/run.sh passes through) both work.
    config_option = argparse.ArgumentParser(add_help=False)
    config_option.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                               help="YAML config file (default: $TESSERA_CONFIG, else built-in defaults)")
    parser = argparse.ArgumentParser(prog="tessera", parents=[config_option],
                                     description="Serve many LoRA adapters on one shared base model.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", parents=[config_option], help="run one role in this process")
    serve.add_argument("role", choices=sorted(ROLE_MODULES))
    serve.set_defaults(run=_serve)
    commands.add_parser("demo-assets", parents=[config_option],
                        help="build the demo models and adapters and register them").set_defaults(run=_demo_assets)
    tasks = commands.add_parser("demo-tasks", parents=[config_option],
                                help="write the synthetic vision task suite of `tessera fuse` (no downloads)")
    tasks.add_argument("--out", type=Path, metavar="DIR", help="where to write it (default: TESSERA_HOME/tasks)")
    tasks.add_argument("--seed", type=int, default=0)
    tasks.add_argument("--train", type=int, default=64, metavar="N", help="train examples per task")
    tasks.add_argument("--eval", type=int, default=32, metavar="N", help="eval examples per task")
    tasks.set_defaults(run=_demo_tasks)
    fuse = commands.add_parser("fuse", parents=[config_option],
                               help="train the fewest LoRA adapters that keep every task of MANIFEST at its floor")
    fuse.add_argument("manifest", type=Path, metavar="MANIFEST", help="the task manifest (docs/fuse.md)")
    fuse.add_argument("--run-dir", type=Path, metavar="DIR",
                      help="where checkpoints, journals and the report go; a rerun continues (default: "
                           "TESSERA_HOME/fuse/<manifest stem>)")
    fuse.add_argument("--register", action="store_true",
                      help="register each fused adapter as <manifest stem>-fused-<i>")
    fuse.set_defaults(run=_fuse)
    up = commands.add_parser("up", parents=[config_option], help="run every role as supervised local processes")
    up.add_argument("--workers", type=int, metavar="N",
                    help="N workers of worker.base_model (default: launcher.workers; 0: one worker for each "
                         "registered base model)")
    up.set_defaults(run=_up)
    commands.add_parser("config", parents=[config_option],
                        help="print the effective configuration as YAML").set_defaults(run=_config)
    certs = commands.add_parser("certs", parents=[config_option],
                                help="create the cluster CA and each role's TLS certificate (keeps valid ones)")
    certs.add_argument("--force", action="store_true",
                       help="replace the CA and every certificate (restart every role afterwards)")
    certs.set_defaults(run=_certs)
    health = commands.add_parser("health", parents=[config_option],
                                 help="exit 0 if the ROLE's gRPC server at ADDRESS is SERVING")
    health.add_argument("address", help="host:port")
    health.add_argument("--role", required=True, choices=GRPC_ROLES,
                        help="the role serving ADDRESS: registry and worker are probed with that role's "
                             "cluster certificate (mutual TLS), gateway as a client would")
    health.add_argument("--timeout", type=float, default=2.0, metavar="SECONDS")
    health.set_defaults(run=_health)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.config = getattr(args, "config", None)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if args.command not in READ_ONLY_COMMANDS:
        make_home_private(config.home_path)
    return args.run(config, args)


if __name__ == "__main__":
    sys.exit(main())
