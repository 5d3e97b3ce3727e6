"""The commands that start training with an export: one rule (`launch_lines`) for the exports'
comments and the CLI, on one node or several (torchrun with c10d rendezvous, `accelerate launch`,
and the `srun` line of a SLURM job)."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autofit.config import DECLARED
from autofit.export.layout import hsdp_env, plan_config, plan_nodes, plan_sharding
from autofit.export.schema import check_format, env_text, plan_document, side_path
from autofit.layout import Sharding
from autofit.settings import HF_LAUNCHES
from autofit.values import Launch, QuantBackend

# autofit cannot know the user's training script: launch commands name this placeholder, and
# `launch_note` says what it stands for and runs the plan with an example shipped in the sources.
TRAIN_SCRIPT = "<your_train.py>"
EXAMPLE_SCRIPTS = {"accelerate": "accelerate_train.py"}  # other formats: train_with_plan.py
TRAINER_EXAMPLE = "trainer_train.py"
"""The example of a `launch: trainer` plan's trainer export: HF Trainer on the model loaded as
its trials loaded it (`from_config`/`from_pretrained`, peft LoRA of the plan's `lora`)."""
TRL_EXAMPLE = "trl_train.py"
"""The example of a `launch: trl` plan's trainer export: TRL's SFTTrainer with its SFTConfig, on
the model loaded as its trials loaded it, given peft's `LoraConfig` of the plan's `lora`."""


def plan_launch(doc: dict[str, Any]) -> str:
    """Whose training loop the plan was made for and measured under (its `launch` setting)."""
    return str((doc.get("config") or {}).get("launch", DECLARED["launch"].default))


def trainer_launch(doc: dict[str, Any]) -> bool:
    """Whether the plan was made for (and measured under) an HF Trainer script: Trainer's own,
    or TRL's SFTTrainer (a Trainer)."""
    return plan_launch(doc) in HF_LAUNCHES


RDZV_PORT = 29500
"""The rendezvous port of a multi-node launch (torchrun's and Accelerate's default)."""
SLURM_FIRST_NODE = "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)"
"""The first node of a SLURM job, expanded by the batch script's shell: the rendezvous host."""
SLURM_NODE_RANK = r"\$SLURM_NODEID"
"""The node's rank inside `srun ... bash -c "..."`: escaped so each task's shell expands it."""


@dataclass(frozen=True)
class LaunchLine:
    command: str
    where: str = ""  # "" on one node; else which nodes run it and what its variables stand for


def launch_lines(
    plan: Any, format: str, path: str | Path, script: str = TRAIN_SCRIPT
) -> list[LaunchLine]:
    """The commands that launch training with this export (the one rule the exports and the CLI
    print). One node: `python` for a one-GPU plain-module plan (no process group needed),
    `torchrun`/`accelerate launch` for DDP and FSDP2. Several nodes: the command each node runs
    (torchrun with c10d rendezvous at node 0, or `accelerate launch` with its machine rank), then
    the `srun` line that runs it once on every node of a SLURM job. `script` is the training
    script (the placeholder `<your_train.py>` unless named); the CUDA allocator setting is set
    only for a CUDA plan; a trainer export of an HSDP plan sets the `PARALLELISM_CONFIG_*`
    variables its Accelerator reads (`hsdp_env`)."""
    format = check_format(format)
    doc = plan if isinstance(plan, dict) else plan_document(plan)
    env = _env_prefix(doc, format)
    p = Path(path)
    if format == "accelerate":
        tail = f"{script} --plan {side_path(p)}"
    elif format == "trainer" and trainer_launch(doc):
        arguments = "SFTConfig" if plan_launch(doc) == Launch.TRL else "TrainingArguments"
        tail = (f"{script}  # {arguments}(**json.load(open('{p}'))) on the model loaded "
                f"as measured: peft LoraConfig of autofit.load_plan('{side_path(p)}')"
                ".document['lora']")  # fmt: skip
    elif format == "trainer":
        tail = (f"{script}  # TrainingArguments(**json.load(open('{p}'))); "
                f"autofit.load_plan('{side_path(p)}') for quant/LoRA")  # fmt: skip
    else:
        tail = f"{script} --plan {p}"
    return _launch_with(doc, format, p, env, tail)


def _env_prefix(doc: dict[str, Any], format: str) -> str:
    """The variables a launch line sets before its command (with a trailing space), or ''."""
    env_vars = " ".join(f"{k}={v}" for k, v in hsdp_env(doc).items()) if format == "trainer" else ""
    env = " ".join(t for t in (env_text(doc), env_vars) if t)
    return f"{env} " if env else ""


def _launch_with(
    doc: dict[str, Any], format: str, p: Path, env: str, tail: str
) -> list[LaunchLine]:
    """`launch_lines` of a command whose script and its arguments are `tail`."""
    n = int(doc["hardware"]["n_gpus"])
    nodes, per_node = plan_nodes(doc)
    if nodes <= 1:
        if format == "accelerate":
            return [LaunchLine(f"{env}accelerate launch --config_file {p} {tail}")]
        single = plan_sharding(doc) is Sharding.NONE
        runner = "python" if single else f"torchrun --nproc-per-node {n}"
        return [LaunchLine(f"{env}{runner} {tail}")]
    srun = f"srun --nodes={nodes} --ntasks-per-node=1 --gpus-per-node={per_node}"
    if format == "accelerate":

        def accelerate(rank: str, host: str) -> str:
            return (
                f"accelerate launch --config_file {p} --num_machines {nodes} --machine_rank {rank}"
                f" --main_process_ip {host} --main_process_port {RDZV_PORT} {tail}"
            )

        node = accelerate("$NODE_RANK", "$MASTER_ADDR")
        slurm = f'bash -c "{accelerate(SLURM_NODE_RANK, SLURM_FIRST_NODE)}"'
        names = f"NODE_RANK: 0 to {nodes - 1}, MASTER_ADDR: node 0's address"
    else:

        def torchrun(host: str, job: str) -> str:
            return (
                f"torchrun --nnodes={nodes} --nproc-per-node={per_node} --rdzv-backend=c10d "
                f"--rdzv-endpoint={host}:{RDZV_PORT} --rdzv-id={job} {tail}"
            )

        node, slurm = (
            torchrun("$MASTER_ADDR", "$JOB_ID"),
            torchrun(SLURM_FIRST_NODE, "$SLURM_JOB_ID"),
        )
        names = "MASTER_ADDR: node 0's address, JOB_ID: any id the nodes share"
    return [
        LaunchLine(f"{env}{node}", f"on each of the {nodes} nodes; {names}"),
        LaunchLine(f"{env}{srun} {slurm}", "under SLURM, from the batch script: one task per node"),
    ]


def launch_command(plan: Any, format: str, path: str | Path, script: str = TRAIN_SCRIPT) -> str:
    """The first of `launch_lines`: the whole command on one node, each node's on several."""
    return launch_lines(plan, format, path, script)[0].command


def launch_comments(doc: dict[str, Any], format: str, path: Path) -> list[str]:
    return [
        f"# Launch{f' ({line.where})' if line.where else ''}: {line.command}"
        for line in launch_lines(doc, format, path)
    ]


def example_script(format: str) -> Path | None:
    """The example training script for `format` (examples/ of autofit's sources), when autofit
    runs from its source tree (a checkout, an editable install); None for an installed wheel."""
    name = EXAMPLE_SCRIPTS.get(format, "train_with_plan.py")
    path = Path(__file__).resolve().parents[2] / "examples" / name
    return path if path.is_file() else None


def launch_note(plan: Any, format: str, path: str | Path) -> str:
    """What `<your_train.py>` in `launch_command` stands for, and a command that runs the plan
    for a few steps with the example script shipped in autofit's sources (random weights)."""
    format = check_format(format)
    doc = plan if isinstance(plan, dict) else plan_document(plan)
    if format == "trainer" and trainer_launch(doc):
        return _trainer_note(doc, Path(path))
    name = EXAMPLE_SCRIPTS.get(format, "train_with_plan.py")
    text = (
        f"{TRAIN_SCRIPT} is your training script: autofit.load_plan(...) then "
        "autofit.apply(model, plan.best.config) builds the measured layout."
    )
    example = example_script(format)
    if example is None:
        return f"{text} examples/{name} in autofit's source repository is a complete one."
    rel = os.path.relpath(example)
    shown = rel if not rel.startswith("..") else str(example)
    p = Path(path)
    plan_file = p if format == "autofit" else side_path(p)
    if format == "accelerate":
        cmd = launch_command(doc, format, p, script=shlex.quote(shown))
    else:
        cmd = launch_command(doc, "autofit", plan_file, script=shlex.quote(shown))
        if doc["hardware"].get("device") == "cuda":
            cmd += " --device cuda"
    cmd += f" --model {shlex.quote(str(doc['model']))}"
    return f"{text} To try the plan with the example {shown} (random weights): {cmd}"


def _trainer_note(doc: dict[str, Any], path: Path) -> str:
    """`launch_note` of a `launch: trainer` (or `trl`) plan's trainer export: the model is loaded
    as its trials loaded it (no `autofit.apply`), and the example that does so."""
    if plan_launch(doc) == Launch.TRL:
        name = TRL_EXAMPLE
        text = (
            f"{TRAIN_SCRIPT} is your TRL script: SFTTrainer(model, args=SFTConfig(**json), "
            "peft_config=LoraConfig of the plan's lora section), the model loaded in the dtype "
            "the plan trains (the JSON's model_init_kwargs, bf16 for a LoRA base; for QLoRA "
            "with its BitsAndBytesConfig), as the trials did; no autofit.apply."
        )
    elif plan_config(doc).quant_backend == QuantBackend.BITSANDBYTES:
        name = TRAINER_EXAMPLE
        text = (
            f"{TRAIN_SCRIPT} is your HF Trainer QLoRA script: load the model with from_pretrained"
            "(..., quantization_config=BitsAndBytesConfig(...), dtype=torch.bfloat16) as the "
            "plan file's header says, run peft's prepare_model_for_kbit_training on it and wrap "
            "it with peft's LoraConfig of the plan's lora section, as the trials did; no "
            "autofit.apply."
        )
    else:
        name = TRAINER_EXAMPLE
        text = (
            f"{TRAIN_SCRIPT} is your HF Trainer script: load the model in the dtype the plan "
            "trains (bf16 for a LoRA base) and wrap it with peft's LoraConfig of the plan's lora "
            "section, as the trials did; no autofit.apply."
        )
    example = Path(__file__).resolve().parents[2] / "examples" / name
    if not example.is_file():
        return f"{text} examples/{name} in autofit's source repository is one."
    rel = os.path.relpath(example)
    shown = rel if not rel.startswith("..") else str(example)
    tail = (
        f"{shlex.quote(shown)} --arguments {shlex.quote(str(path))} "
        f"--plan {shlex.quote(str(side_path(path)))}"
    )
    if doc["hardware"].get("device") == "cuda":
        tail += " --device cuda"
    # started as the plan's own launch line starts it: python, or torchrun on several GPUs
    cmd = _launch_with(doc, "trainer", path, _env_prefix(doc, "trainer"), tail)[0].command
    return f"{text} To try the plan with the example {shown} (random weights): {cmd}"
