"""The table of configs that fit, sized for the terminal: a row per recipe (`RECIPE_KNOBS`), rows
numbered as shown in ranked order, and only the columns whose values differ among the rows
shown; what every row shares is one line under it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from autofit.config import DECLARED, Config
from autofit.plan import Candidate, Plan
from autofit.plan.rank import TIE_BREAK, TIE_TOLERANCE, recipe_key
from autofit.units import all_together, device_noun, fmt_size


@dataclass(frozen=True)
class Column:
    """One knob's column: its header, how a config's cell reads, and how the line of shared
    values names it."""

    header: str
    cell: Any  # Callable[[Config], str]
    shared: str  # `{}` is the cell's text


def _base(cfg: Config) -> str:
    """The base cell: `quant`'s and `lora_rank`'s label parts, `full`, `lora r16`, `nf4 r64`."""
    return " ".join(part for k in ("quant", "lora_rank") if (part := DECLARED[k].label(cfg)))


KNOB_COLUMNS = (
    Column("base", _base, "{} fine-tune"),
    Column("mb x acc", lambda c: f"{c.micro_batch} x {c.grad_accum}", "micro-batch x accum {}"),
    Column("wrap", lambda c: c.wrap, "wrap {}"),
    Column("shard", lambda c: c.shard, "shard {}"),
    Column("reshard", lambda c: "yes" if c.reshard else "no", "reshard {}"),
    Column("ckpt", lambda c: c.checkpointing, "checkpointing {}"),
    Column("offload", lambda c: c.offload, "offload {}"),
    Column("optim", lambda c: c.optimizer, "optimizer {}"),
    Column("precision", lambda c: c.precision, "precision {}"),
    Column("loss", lambda c: c.loss, "loss {}"),
    Column("compile", lambda c: "yes" if c.compile else "no", "compile {}"),
    Column("batching", lambda c: c.batching, "batching {}"),
)


def _label_parts(cfg: Config) -> dict[str, str]:
    """`Config.short()`'s parts by knob (the base as one part, `lora r16`): the narrow table's
    `config` cell joins those that differ among the rows shown."""
    parts = {"base": _base(cfg)}
    for name, d in DECLARED.items():
        if d.label is not None and name not in ("quant", "lora_rank"):
            parts[name] = d.label(cfg) or ""
    return parts


def shown_rows(plan: Plan, limit: int) -> list[tuple[Candidate, int]]:
    """The best `limit` distinct recipes in ranked order, each the best-ranked (and plainest) of
    its variants, with how many lower-ranked variants it stands for."""
    rows: dict[tuple[Any, ...], list[Any]] = {}
    for c in plan.ranked:
        key = recipe_key(c.config)
        if key in rows:
            rows[key][1] += 1
        elif len(rows) < limit:
            rows[key] = [c, 0]
    return [(c, n) for c, n in rows.values()]


class RankedTable:
    """The ranked configs that fit (`plan_table`), laid out when printed, for the width there:
    a column per knob whose values differ among the rows shown where they fit, else one
    `config` column of the rows' labels (less what every row shares), which wraps."""

    def __init__(self, plan: Plan, limit: int) -> None:
        self.plan = plan
        self.rows = shown_rows(plan, limit)
        # without the data's lengths every sequence is seq_len: batching is not a choice there
        data = plan.request.lengths is not None
        self.columns = [k for k in KNOB_COLUMNS if data or k.header != "batching"]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        rows = self.rows
        varying = [k for k in self.columns if len({k.cell(c.config) for c, _ in rows}) > 1]
        more = any(v for _, v in rows)
        table = self._table(varying, more)
        natural = console.measure(table, options=options.update_width(10_000)).maximum
        if natural > options.max_width:
            table = self._table(None, more)
        yield table
        yield from (Text(line) for line in self._notes(varying, more))

    def _table(self, columns: list[Column] | None, more: bool) -> Table:
        """The table with a column per knob of `columns`, or (None) one `config` column."""
        rows = self.rows
        measured = any(c.measured for c, _ in rows)
        title = "Configs that fit, fastest first" + (
            " (m: measured)" if measured else " (estimates)"
        )
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        table.add_column("#", justify="right")
        table.add_column("tokens/s", justify="right", no_wrap=True)
        table.add_column("peak", justify="right", no_wrap=True)
        data = self.plan.request.lengths is not None  # the padding share differs only there
        if data:
            table.add_column("pad", justify="right", no_wrap=True)
        parts = [_label_parts(c.config) for c, _ in rows]
        differ = [k for k in parts[0] if len({p[k] for p in parts}) > 1]
        for k in columns or []:
            table.add_column(k.header)
        if columns is None:
            table.add_column("config", ratio=1)
        if more:
            table.add_column("more", justify="right")
        for i, ((c, variants), part) in enumerate(zip(rows, parts, strict=True), 1):
            tag = " m" if c.measured else ""
            if columns is None:
                cells = [" ".join(part[k] for k in differ if part[k])]
            else:
                cells = [k.cell(c.config) for k in columns]
            table.add_row(
                str(i),
                f"{c.tokens_per_s:,.0f}{tag}",
                f"{fmt_size(c.peak_bytes)}{tag}",
                *([f"{c.estimate.padding_share:.0%}"] if data else []),
                *cells,
                *([f"+{variants}" if variants else ""] if more else []),
            )
        return table

    def _notes(self, varying: list[Column], more: bool) -> list[str]:
        plan, rows = self.plan, self.rows
        n = plan.hardware.n_gpus
        notes = [
            (f"tokens/s: {all_together(n, plan.device)}; " if n > 1 else "")
            + f"peak: reserved memory per {device_noun(plan.device)}.",
            *(
                [
                    "With the data: tokens/s counts useful tokens (pad: the padding share "
                    "excluded); peak is at the longest micro-batch the data can produce."
                ]
                if plan.request.lengths is not None
                else []
            ),
            f"Order: tokens/s in steps of {TIE_TOLERANCE:.1%} (a tie); within a step, {TIE_BREAK}.",
        ]
        same = [
            k.shared.format(k.cell(rows[0][0].config)) for k in self.columns if k not in varying
        ]
        if same:
            notes.append("Every row: " + ", ".join(same) + ".")
        if more:
            notes.append(
                "more: configs of the row's recipe that differ only in reshard, offload, "
                "optimizer or precision, ranked lower."
            )
        recipes = len({recipe_key(c.config) for c in plan.ranked})
        if recipes > len(rows):
            notes.append(f"The best {len(rows)} of {recipes:,} recipes that fit are shown.")
        return notes


def plan_table(plan: Plan, limit: int = 15) -> RankedTable:
    """The ranked configs that fit: the best `limit` recipes numbered 1.. as shown, fastest
    first, sized for the terminal when printed (`RankedTable`)."""
    return RankedTable(plan, limit)
