"""A Flower app (ServerApp + ClientApp, FedAvg) whose parameters travel through deltastore.

The app fine-tunes all-MiniLM-L6-v2 (bf16 global model, fp32 local masters) on N sites, each on
its own share of the demo's pairs, for a few AdamW steps per round. It runs twice, under
Flower's simulation engine, on a local S3 server (deltastore.devserver's moto server), with
the same seeds:

- ``deltastore``: :class:`~deltastore.integrations.flower.DeltastoreFedAvg` publishes the global
  model to ``run/global``; Flower's messages carry only version references; each site pulls the
  global version (a verified fast-forward after its first pull), trains, publishes its change as
  a based version to ``run/sites/site-N`` and replies with a reference;
- ``flower``: :class:`~deltastore.integrations.flower.InlineFedAvg`, the same rounds on Flower's
  own transport (full bf16 weights in every ArrayRecord message, merged by the same function);
- with ``--compressed [DENSITY]``, ``compressed``: the deltastore run again, each site sending
  compressed results (the opt-in compressed tier: the DENSITY fraction of each tensor's largest
  changes of its fp32 masters, quantized to ``--bits``, the rest kept by the site as error
  feedback) to a strategy that accepts them. The last :data:`HELDOUT_PAIRS` pairs are then held
  out of every run's training, and each run's global versions are scored on them.

    python examples/flower_app.py                      # 2 sites, 3 rounds, simulation engine
    python examples/flower_app.py --sites 3 --rounds 2 --steps 1
    python examples/flower_app.py --deployment         # real processes on 127.0.0.1
    python examples/flower_app.py --compressed --lr 2e-5 --steps 4 --rounds 6 --plot heldout.svg

``--deployment`` runs the same app on a ``flower-superlink``, one ``flower-supernode`` per site
(its ``partition-id`` in ``--node-config``) and ``flwr run``; every message then runs in a fresh
ClientApp process, so each SuperNode gets a node cache (``DELTASTORE_NODE_CACHE``) to keep the
packs it already fetched.

The last stdout line is one JSON object: rounds, sites, model_bytes (the bf16 model),
upload_bytes_per_site_round and download_bytes_per_site_round (medians of every byte a site's
S3 requests carried, manifests and HEAD included; download counts the fast-forwards after each
site's first full pull, as examples/federated.py does), flower_bytes_per_site_round (median
ArrayRecord bytes of one site's round on Flower's transport, down plus up; the two directions
apart as flower_download_bytes_per_site_round / flower_upload_bytes_per_site_round),
upload_fraction / download_fraction (of model_bytes), same_as_flower (the two runs' final
global weights are bit-identical) and global_bit_exact (the global store's last version is the
deltastore run's final weights). ``--compressed`` adds heldout_loss and lossless_heldout_loss
(the held-out loss of the compressed and of the lossless run's final global version),
heldout_loss_ratio, the per-round curves (heldout_curve, lossless_heldout_curve: one loss per
global version, the initial one first), compressed_upload_bytes_per_site_round and
compressed_upload_fraction, and compressed_bit_exact (the compressed run's global store holds
its final weights); ``--plot FILE`` draws both curves (needs matplotlib). Exit status 0 when
every check holds, 1 otherwise.

The ServerApp and ClientApp below are ordinary Flower components: ``flwr run`` / a SuperLink
with SuperNodes can load them (``examples.flower_app:server`` / ``:client``) given the
``DELTASTORE_FLOWER_APP`` environment variable this script sets (a JSON object: transport, store
URLs and S3 options, rounds, steps, lr, where the final weights and traffic log go).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo import PAIRS, WEIGHT_DECAY, export_bf16, model_dir  # noqa: E402
from federated import local_steps  # noqa: E402

from flwr.app import ArrayRecord, Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from deltastore.integrations.flower import (  # noqa: E402
    DeltastoreFedAvg,
    FlowerSite,
    InlineFedAvg,
    arrays_to_state,
    inline_reply,
    state_to_arrays,
)

logger = logging.getLogger("deltastore.examples.flower_app")

#: The app's configuration (JSON), read by the ServerApp and every ClientApp: simulation
#: actors inherit the environment of the process that starts them.
CONFIG_ENV = "DELTASTORE_FLOWER_APP"
DEFAULT_SITES = 2
DEFAULT_ROUNDS = 3
#: Local AdamW steps per site per round.
DEFAULT_STEPS = 2
#: The demo's fine-tuning learning rate (RL-like, where bf16 changes are sparse).
DEFAULT_LR = 3e-6
SEED = 0
#: Pairs held out of training with ``--compressed``, to score every run's global versions on.
HELDOUT_PAIRS = 8
#: The compressed tier's default density (``--compressed`` without a value) and bits.
DEFAULT_DENSITY = 0.01
DEFAULT_BITS = 2
#: One simulated node at a time on all the cores: two cores train one MiniLM faster than two
#: half-cores train two, and every site's held global copy then lives in one actor process.
NODE_CPUS = 2


def config() -> dict[str, Any]:
    return json.loads(os.environ[CONFIG_ENV])


def log_traffic(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:  # one short line per append: whole lines, whatever process writes
        f.write(json.dumps(record) + "\n")


# --- the ClientApp ---------------------------------------------------------------------------

client = ClientApp()
#: Per (transport, site): the site's model, optimizer, data, and its FlowerSite with byte counters.
_locals: dict[tuple[str, int], dict[str, Any]] = {}


def _local(cfg: dict[str, Any], site: int, n_sites: int) -> dict[str, Any]:
    key = (cfg["transport"], site)
    if key in _locals:
        return _locals[key]
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(NODE_CPUS)
    torch.manual_seed(SEED + site)
    model = AutoModel.from_pretrained(str(model_dir()), dtype=torch.float32)
    model.train()
    local: dict[str, Any] = {
        "tokenizer": AutoTokenizer.from_pretrained(str(model_dir())), "model": model,
        "opt": torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=WEIGHT_DECAY),
        "pairs": training_pairs(cfg)[site::n_sites],  # each site trains on different data
    }
    if cfg["transport"] in ("deltastore", "compressed"):
        from federated import count_bytes

        from deltastore import WriterPolicy
        from deltastore.storage import open_store

        site_url = cfg["sites"][f"site-{site}"]
        global_store = open_store(cfg["global"], storage_options=cfg["options"])
        site_store = open_store(site_url, storage_options=cfg["options"])
        local["down"], local["up"] = count_bytes(global_store), count_bytes(site_store)
        compression, residual = None, None
        if cfg["transport"] == "compressed":
            from deltastore.federated import Compression

            compression = Compression(density=cfg["density"], bits=cfg["bits"])
            # a SuperNode runs each message in a fresh process: the error feedback lives in a file
            residual = str(Path(cfg["traffic"]).parent / f"residual-site-{site}.safetensors")
        local["site"] = FlowerSite(site_url, name=f"site-{site}", dtype=torch.bfloat16, global_store=global_store,
                                   site_store=site_store, writer_policy=WriterPolicy(threads=1, writer_id=f"site-{site}"),
                                   compression=compression, residual_path=residual)
    _locals[key] = local
    return local


def training_pairs(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    """The pairs sites train on: all of them, or all but the held-out ones."""
    return PAIRS[:-HELDOUT_PAIRS] if cfg.get("heldout") else list(PAIRS)


def _train(local: dict[str, Any], weights: dict[str, torch.Tensor], site: int, rnd: int, steps: int,
           masters: bool = False) -> tuple[dict[str, torch.Tensor], float]:
    """A site's round; ``masters``: return the fp32 masters (what the compressed tier takes
    its change from) instead of the bf16 export."""
    torch.manual_seed(SEED + 1000 * rnd + site)  # dropout: the same draws on either transport
    state, loss = local_steps(local["model"], local["tokenizer"], local["opt"], local["pairs"], weights, rnd, steps)
    if masters:
        state = {n: t.detach().clone() for n, t in local["model"].state_dict().items()}
    return state, loss


@client.train()
def train(msg: Message, context: Context) -> Message:
    """Train on this site's pairs from the global weights the message names (or carries)."""
    cfg = config()
    site, n_sites = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    rnd = int(msg.content.config_records["config"]["server-round"])
    local = _local(cfg, site, n_sites)
    if cfg["transport"] in ("deltastore", "compressed"):
        fs: FlowerSite = local["site"]
        d0, u0 = sum(local["down"].values()), sum(local["up"].values())
        weights = fs.pull(msg)
        state, loss = _train(local, weights, site, rnd, cfg["steps"], masters=cfg["transport"] == "compressed")
        reply = fs.reply(msg, state, num_examples=len(local["pairs"]), metrics={"train-loss": loss})
        down, up = sum(local["down"].values()) - d0, sum(local["up"].values()) - u0
    else:
        record: ArrayRecord = msg.content.array_records["arrays"]
        weights = arrays_to_state(record)
        state, loss = _train(local, weights, site, rnd, cfg["steps"])
        reply = inline_reply(msg, state, site=f"site-{site}", num_examples=len(local["pairs"]),
                             metrics={"train-loss": loss}, dtype=torch.bfloat16)
        down, up = record.count_bytes(), reply.content.array_records["arrays"].count_bytes()
    log_traffic(cfg["traffic"], {"transport": cfg["transport"], "site": site, "round": rnd, "down": down, "up": up,
                                 "loss": loss})
    return reply


# --- the ServerApp ---------------------------------------------------------------------------

server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    """FedAvg over every node, each round, on the transport the configuration names."""
    from safetensors.torch import save_file

    cfg = config()
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoModel

    initial = export_bf16(AutoModel.from_pretrained(str(model_dir()), dtype=torch.float32))
    n = len(cfg["sites"])
    fedavg = dict(fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n)
    ours = cfg["transport"] in ("deltastore", "compressed")
    if ours:
        from deltastore.federated import ResultPolicy

        strategy: Any = DeltastoreFedAvg(cfg["global"], cfg["sites"], dtype=torch.bfloat16, storage_options=cfg["options"],
                                         site_storage_options=cfg["options"],
                                         results=ResultPolicy(accept_compressed=cfg["transport"] == "compressed"),
                                         **fedavg)
    else:
        strategy = InlineFedAvg(dtype=torch.bfloat16, **fedavg)
    try:
        result = strategy.start(grid, state_to_arrays(initial), num_rounds=cfg["rounds"])
        save_file(arrays_to_state(result.arrays), cfg["final"])
        if ours:
            rounds = [{"round": r.server_round, "published": r.published.version if r.published else None,
                       "accepted": list(r.accepted), "failures": [f.error_type for f in r.failures],
                       "bytes_up": list(r.bytes_up)} for r in strategy.rounds]
            Path(cfg["final"]).with_suffix(".rounds.json").write_text(json.dumps(rounds))
    finally:
        if ours:
            strategy.close()


# --- the two runs ----------------------------------------------------------------------------


def simulate(cfg: dict[str, Any], n_sites: int) -> float:
    """Run the app under Flower's simulation engine with ``cfg``. Returns the wall time."""
    from flwr.simulation import run_simulation

    os.environ[CONFIG_ENV] = json.dumps(cfg)
    # the simulation's actors import this module and demo.py by name
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, str(Path(here).parent), os.environ.get("PYTHONPATH", "")])
    # By module, not by value: the actors then import it once and keep its caches (_locals)
    # across rounds, as a SuperNode's long-lived ClientApp process does.
    import flower_app as app

    t0 = time.monotonic()
    run_simulation(server_app=app.server, client_app=app.client, num_supernodes=n_sites,
                   backend_config={"client_resources": {"num_cpus": NODE_CPUS, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": NODE_CPUS, "include_dashboard": False}})
    return time.monotonic() - t0


#: Seconds a deployment run (SuperLink, SuperNodes, ``flwr run``) may take before it is stopped.
DEPLOY_TIMEOUT_S = 600.0


#: Seconds the SuperLink may take to open its Control API.
LISTEN_TIMEOUT_S = 60.0


def wait_listening(port: int, proc: Any, log: Path) -> None:
    """Return once 127.0.0.1:``port`` accepts connections; SystemExit if ``proc`` dies first."""
    import socket

    end = time.monotonic() + LISTEN_TIMEOUT_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"flower-superlink exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise SystemExit(f"flower-superlink did not listen on {port} within {LISTEN_TIMEOUT_S:g} s")


def _log_tails(workdir: Path) -> str:
    """The end of every log the deployment wrote (the SuperLink's, each SuperNode's, ``flwr run``'s)."""
    return "".join(f"\n--- {f.name}\n{f.read_text(errors='replace')[-2000:]}" for f in sorted(workdir.glob("*.log")))


def deploy(cfg: dict[str, Any], n_sites: int, workdir: Path) -> float:
    """Run the app on real Flower processes on 127.0.0.1: one SuperLink, one SuperNode per
    site (its ``partition-id`` in its node config), submitted with ``flwr run``. Returns the wall
    time. Raises SystemExit when the run fails (Flower's logs are in ``workdir``)."""
    import socket
    import subprocess

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    here = Path(__file__).resolve().parent
    bindir = Path(sys.executable).parent
    port = free_port()
    env = dict(os.environ, **{CONFIG_ENV: json.dumps(cfg), "FLWR_HOME": str(workdir / "flwr-home"),
                              "PATH": os.pathsep.join([str(bindir), os.environ.get("PATH", "")]),
                              "PYTHONPATH": os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])})
    app = workdir / "app"  # the Flower app project: its components are this module's apps
    app.mkdir(parents=True, exist_ok=True)
    (app / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "deltastoreflower"\nversion = "1.0.0"\ndependencies = []\n\n'
        '[tool.flwr.app]\npublisher = "deltastore"\n\n'
        '[tool.flwr.app.components]\nserverapp = "flower_app:server"\nclientapp = "flower_app:client"\n\n'
        '[tool.flwr.app.config]\n')
    (app / "app_marker.py").write_text('"""The app\'s components live in examples/flower_app.py (PYTHONPATH)."""\n')
    home = workdir / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    procs: list[subprocess.Popen] = []
    logs = []

    def start(name: str, argv: list[str], **more_env: str) -> None:
        log = open(workdir / f"{name}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(argv, env={**env, **more_env}, stdout=log, stderr=subprocess.STDOUT,
                                      cwd=str(workdir)))

    t0 = time.monotonic()
    try:
        # one HTTP port serves the SuperLink's Fleet, Control and Runtime APIs
        start("superlink", [str(bindir / "flower-superlink"), "--insecure", "--database", str(workdir / "state.db"),
                            "--host", "127.0.0.1", "--port", str(port)])
        for i in range(n_sites):
            start(f"supernode-{i}", [str(bindir / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
                                     "--node-config", f"partition-id={i} num-partitions={n_sites}",
                                     "--port", str(free_port())],
                  # each message runs in a fresh ClientApp process: the node cache (one per host,
                  # docs/fleet.md) keeps the packs already fetched, so a round's pull takes only
                  # the new ones from the bucket
                  DELTASTORE_NODE_CACHE=str(workdir / f"node-cache-{i}"))
        wait_listening(port, procs[0], workdir / "superlink.log")
        try:
            submit = subprocess.run([str(bindir / "flwr"), "run", str(app), "local", "--stream"], env=env,
                                    cwd=str(workdir), timeout=DEPLOY_TIMEOUT_S, capture_output=True, text=True)
        except subprocess.TimeoutExpired as e:  # Flower's own logs say where it stopped
            partial = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
            (workdir / "flwr-run.log").write_text("".join(partial))
            raise SystemExit(f"flwr run did not finish within {DEPLOY_TIMEOUT_S:g} s:{_log_tails(workdir)}") from e
        (workdir / "flwr-run.log").write_text(submit.stdout + submit.stderr)
        if submit.returncode != 0 or not Path(cfg["final"]).exists():
            raise SystemExit(f"flwr run failed ({submit.returncode}):{_log_tails(workdir)}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            log.close()
    return time.monotonic() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    from safetensors.torch import load_file

    from deltastore import Subscriber
    from deltastore.devserver import moto

    model_bytes = 0
    transports = ("deltastore", "flower", "compressed") if args.compressed else ("deltastore", "flower")
    prefix = {"deltastore": "run", "flower": "run", "compressed": "run/compressed"}
    with moto() as s3, tempfile.TemporaryDirectory(prefix="flower-app-") as out:
        options = s3.storage_options()
        traffic = str(Path(out) / "traffic.jsonl")
        finals, stored, curves = {}, {}, {}
        for transport in transports:
            root = prefix[transport]
            cfg = {"transport": transport, "global": s3.url(f"{root}/global"), "options": options,
                   "sites": {f"site-{i}": s3.url(f"{root}/sites/site-{i}") for i in range(args.sites)},
                   "rounds": args.rounds, "steps": args.steps, "lr": args.lr, "traffic": traffic,
                   "heldout": bool(args.compressed), "density": args.compressed, "bits": args.bits,
                   "final": str(Path(out) / f"final-{transport}.safetensors")}
            if args.deployment:
                wall = deploy(cfg, args.sites, Path(out) / transport)
            else:
                wall = simulate(cfg, args.sites)
            print(f"{transport} transport ({'SuperLink + SuperNodes' if args.deployment else 'simulation'}): "
                  f"{args.rounds} rounds of {args.sites} sites in {wall:.1f} s")
            if not Path(cfg["final"]).exists():
                raise SystemExit(f"the {transport} run ended without final weights (see Flower's log above)")
            finals[transport] = load_file(cfg["final"])
            if transport != "flower":
                with Subscriber(cfg["global"], storage_options=options) as sub:
                    latest = sub.latest()
                    stored[transport] = (latest.version, sub.pull(latest.version))
                    if args.compressed:  # every round's global version, scored on the held-out pairs
                        curves[transport] = heldout_losses([sub.pull(v) for v in range(1, latest.version + 1)])
        model_bytes = sum(t.numel() * t.element_size() for t in finals["flower"].values())
        records = [json.loads(line) for line in Path(traffic).read_text().splitlines()]
    ds = sorted((r for r in records if r["transport"] == "deltastore"), key=lambda r: (r["round"], r["site"]))
    fl = [r for r in records if r["transport"] == "flower"]
    first = {}
    for r in ds:
        first.setdefault(r["site"], r["round"])
    downloads = [r["down"] for r in ds if r["round"] != first[r["site"]]]
    for r in ds:
        print(f"round {r['round']} site-{r['site']}: down {r['down']} B, up {r['up']} B "
              f"({100 * r['up'] / model_bytes:.2f}% of the model), loss {r['loss']:.4f}")
    same = _same(finals["deltastore"], finals["flower"])
    exact = _same(finals["deltastore"], stored["deltastore"][1]) and stored["deltastore"][0] == args.rounds + 1
    result: dict[str, Any] = {
        "rounds": args.rounds,
        "sites": args.sites,
        "model_bytes": model_bytes,
        "upload_bytes_per_site_round": statistics.median(r["up"] for r in ds),
        "download_bytes_per_site_round": statistics.median(downloads) if downloads else None,
        "flower_bytes_per_site_round": statistics.median(r["down"] + r["up"] for r in fl),
        "flower_download_bytes_per_site_round": statistics.median(r["down"] for r in fl),
        "flower_upload_bytes_per_site_round": statistics.median(r["up"] for r in fl),
        "upload_fraction": round(statistics.median(r["up"] for r in ds) / model_bytes, 5),
        "download_fraction": round(statistics.median(downloads) / model_bytes, 5) if downloads else None,
        "same_as_flower": same,
        "global_bit_exact": exact,
        "runtime": "deployment" if args.deployment else "simulation",
    }
    if args.compressed:
        cs = [r for r in records if r["transport"] == "compressed"]
        up = statistics.median(r["up"] for r in cs)
        for r in sorted(cs, key=lambda r: (r["round"], r["site"])):
            print(f"compressed round {r['round']} site-{r['site']}: up {r['up']} B ({100 * r['up'] / model_bytes:.2f}% "
                  f"of the model), loss {r['loss']:.4f}")
        loss, lossless = curves["compressed"][-1], curves["deltastore"][-1]
        result.update({
            "density": args.compressed, "bits": args.bits, "lr": args.lr, "steps": args.steps, "seed": SEED,
            "heldout_pairs": HELDOUT_PAIRS,
            "compressed_upload_bytes_per_site_round": up,
            "compressed_upload_fraction": round(up / model_bytes, 5),
            "heldout_curve": [round(x, 5) for x in curves["compressed"]],
            "lossless_heldout_curve": [round(x, 5) for x in curves["deltastore"]],
            "heldout_loss_ratio": round(loss / lossless, 5),
            "compressed_bit_exact": _same(finals["compressed"], stored["compressed"][1])
            and stored["compressed"][0] == args.rounds + 1,
            "heldout_loss": round(loss, 5),
            "lossless_heldout_loss": round(lossless, 5),
        })
        if args.plot:
            plot_heldout(result, args.plot)
    return result


def heldout_losses(states: list[dict[str, torch.Tensor]]) -> list[float]:
    """The demo's contrastive loss of each state on the held-out pairs (eval mode: no dropout)."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoModel, AutoTokenizer

    from demo import MAX_LEN, SIMILARITY_SCALE

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir()))
    model = AutoModel.from_pretrained(str(model_dir()), dtype=torch.float32)
    model.eval()
    pairs = PAIRS[-HELDOUT_PAIRS:]

    def embed(texts: list[str]) -> torch.Tensor:
        enc = tokenizer(texts, padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1), dim=-1)

    out = []
    with torch.no_grad():
        for state in states:
            model.load_state_dict({n: t.to(torch.float32) if t.is_floating_point() else t for n, t in state.items()})
            scores = SIMILARITY_SCALE * embed([a for a, _ in pairs]) @ embed([b for _, b in pairs]).T
            labels = torch.arange(len(pairs))
            out.append(float((torch.nn.functional.cross_entropy(scores, labels)
                              + torch.nn.functional.cross_entropy(scores.T, labels)) / 2))
    return out


def plot_heldout(result: dict[str, Any], path: str) -> None:
    """Both runs' held-out loss per round, and the compressed upload, in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    rounds = list(range(len(result["lossless_heldout_curve"])))
    ax.plot(rounds, result["lossless_heldout_curve"], marker="o", color="#0072B2",
            label=f"lossless (up {100 * result['upload_fraction']:.2f} % of the model per site-round)")
    ax.plot(rounds, result["heldout_curve"], marker="s", color="#E69F00",
            label=f"compressed: top {100 * result['density']:g} %, {result['bits']} bits, error feedback "
                  f"(up {100 * result['compressed_upload_fraction']:.2f} %)")
    ax.set_xlabel("round (0: the initial global version)")
    ax.set_ylabel(f"held-out loss ({result['heldout_pairs']} pairs)")
    ax.set_title(f"all-MiniLM-L6-v2, {result['sites']} sites, {result['steps']} AdamW steps/round at lr {result['lr']:g}, "
                 f"seed {result['seed']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
        and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)) for n in a)


def main_cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", type=int, default=DEFAULT_SITES)
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="local AdamW steps per site per round")
    ap.add_argument("--lr", type=float, default=DEFAULT_LR)
    ap.add_argument("--deployment", action="store_true",
                    help="real Flower processes on 127.0.0.1 (SuperLink, SuperNodes, flwr run) instead of the simulation engine")
    ap.add_argument("--compressed", type=float, nargs="?", const=DEFAULT_DENSITY, metavar="DENSITY",
                    help=f"also run the compressed tier (default density {DEFAULT_DENSITY}) and score every run on "
                         f"{HELDOUT_PAIRS} held-out pairs")
    ap.add_argument("--bits", type=int, default=DEFAULT_BITS, help="bits per sent value with --compressed (1 to 8)")
    ap.add_argument("--plot", metavar="FILE", help="with --compressed: draw the held-out loss curves (matplotlib)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.sites < 1 or args.rounds < 1 or args.steps < 1:
        ap.error("--sites, --rounds and --steps must be ≥ 1")
    if args.compressed is not None and not (0 < args.compressed <= 1 and 1 <= args.bits <= 8):
        ap.error("--compressed takes a density in (0, 1] and --bits 1 to 8")
    if args.plot and args.compressed is None:
        ap.error("--plot draws the held-out curves of --compressed")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(processName)s %(name)s: %(message)s")
    out = run(args)
    print(json.dumps(out))
    ok = out["same_as_flower"] and out["global_bit_exact"] and out.get("compressed_bit_exact", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_cli())
