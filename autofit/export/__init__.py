"""The winner as files other tools read: an `autofit` YAML plan, an Accelerate config, or
`transformers.TrainingArguments` JSON, each for the path the trials measured: the plain module on
one GPU (`distributed_type: NO`), DDP replicas (`MULTI_GPU`) or FSDP2 laid out as torchtitan
(`FSDP`, `fsdp_version: 2`), as `autofit.layout.sharding_for(wrap, n_gpus)` decides; across nodes
with `shard: node`, HSDP on the mesh of `autofit.layout.mesh_shape` (Accelerate's
`parallelism_config`). `launch_lines` is the one rule for the commands that start training: one
line on one node; on several, torchrun with c10d rendezvous on each node and the `srun` line that
starts it on every node of a SLURM job.

Every format is rendered in full and parsed back before anything touches the disk, then written
atomically (`autofit.files.atomic_write`), so a crash never leaves half a file. An existing file
is replaced only when autofit wrote it. What a format cannot say (quantization, LoRA, the
allocator setting) goes into comments, and the `accelerate` and `trainer` exports come with a side
file `<name>.autofit.yaml`: the full plan, which `autofit.load_plan` reads so the training script
can `autofit.apply` the rest.

The rooms: `schema` (the plan document), `loaded` (`load_plan`: a plan read back), `plan_file`
(the plan file's pydantic model, written and read through), `layout` (the measured sharding,
mesh and device), `prose` (the comment lines), `render` (the three formats), `launch` (launch
commands), `write` (checks and atomic writes).
"""

from autofit.export.launch import (
    TRAIN_SCRIPT,
    LaunchLine,
    example_script,
    launch_command,
    launch_lines,
    launch_note,
)
from autofit.export.layout import hsdp_env
from autofit.export.loaded import LoadedBest, LoadedPlan, load_plan
from autofit.export.render import (
    accelerate_config,
    render_accelerate,
    render_autofit,
    trainer_arguments,
)
from autofit.export.schema import FORMATS, check_format, lora_section, plan_document
from autofit.export.write import check_export_target, export_plan

__all__ = [
    "FORMATS",
    "TRAIN_SCRIPT",
    "LaunchLine",
    "LoadedBest",
    "LoadedPlan",
    "accelerate_config",
    "check_export_target",
    "check_format",
    "example_script",
    "export_plan",
    "hsdp_env",
    "launch_command",
    "launch_lines",
    "launch_note",
    "load_plan",
    "lora_section",
    "plan_document",
    "render_accelerate",
    "render_autofit",
    "trainer_arguments",
]
