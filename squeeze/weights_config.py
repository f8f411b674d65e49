"""A recipe's ``weights`` section: how target linears are quantized (WeightsConfig), its block-wise tuning
(TuningConfig), and the tables and bounds their checks use. Re-exported by squeeze.config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal

from squeeze.config_values import OMIT_DEFAULT
from squeeze.errors import ConfigError
from squeeze.limits import (
    LUT_DTYPES,
    MAX_GENERATED_SAMPLES,
    SENSITIVITIES,
    WEIGHT_BITS,
    LutDtype,
    Sensitivity,
    check_at_least,
    check_choice,
    check_group_size,
    check_seed,
    check_sparse_fractions,
    check_weight_bits,
)
from squeeze.models.families import default_targets
from squeeze.quant.schemes import format_for_recipe, formats, methods, recipe_options

#: Kept for callers of the old name; the table is squeeze.limits.
SUPPORTED_BITS = WEIGHT_BITS
#: The bits ``weights.embedding_bits`` may ask for.
EMBEDDING_BITS = (4, 6, 8)
#: ``weights.embedding_bits: auto``: a ``target_bpw`` budget chooses the width (or none) per embedding.
EmbeddingAuto = Literal["auto"]
EMBEDDING_AUTO: EmbeddingAuto = "auto"
#: The WeightsConfig options that only error compensation reads (each must keep its default without it).
ERROR_COMPENSATION_OPTIONS = (
    "damp",
    "refit_lut",
    "refit_rounds",
    "act_order",
    "generated_samples",
    "lnq_rounds",
    "lnq_ridge",
    "lnq_shrink",
    "lnq_held_out",
)
#: The LUT refit against the loss (``weights.lnq_*``, squeeze.quant.lnq): its options beside ``lnq_rounds``.
LNQ_OPTIONS = ("lnq_ridge", "lnq_shrink", "lnq_held_out")
#: The most ridge ``weights.lnq_ridge`` may ask for: beyond it every level stays at its k-means value.
MAX_LNQ_RIDGE = 100.0
#: The most rounds ``weights.refit_rounds`` may ask for (each is one more compensation pass per linear).
MAX_REFIT_ROUNDS = 8

# Package data (shipped in the wheel), not the repository root: an installed squeeze has its built-ins too.

#: Upper bounds of ``weights.tuning``: beyond them a run costs hours on one block and gains nothing measured.
MAX_TUNING_STEPS = 100_000
MAX_TUNING_LR = 1.0
#: The most of a linear's codes ``weights.tuning.code_moves`` may move a step (PV-tuning moves at most 1%).
MAX_CODE_MOVES = 0.05
LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class TuningConfig:
    """``weights.tuning``: block-wise tuning of the LUT values and norm gains after quantization
    (squeeze.quant.tuning; the stage is squeeze.compression.tuning_stage). Codes and format never change."""

    #: Adam steps per decoder block, one calibration window each (early stop on a held-out slice may end sooner).
    steps: int = 64
    #: Adam learning rate of the LUT values and the norm gains.
    lr: float = 1e-4
    #: Calibration tokens the tuning uses at most (whole windows of the calibration's seq_len; 1/8 of them, at
    #: least one window, are held out for the early stop).
    tokens: int = 16384
    #: Seeds the order in which each block's windows are visited.
    seed: int = 0
    #: The share of each linear's codes that may move to their nearest level after each step (PV-tuning: at
    #: most 0.01); 0: the codes stay as quantized (only levels and norm gains train).
    code_moves: float = field(default=0.0, metadata=OMIT_DEFAULT)
    #: ``constant`` or ``cosine`` (the rate decays to 0 over ``steps``).
    lr_schedule: Literal["constant", "cosine"] = field(default="constant", metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        check_at_least(self.steps, 1, "weights.tuning.steps")
        if self.steps > MAX_TUNING_STEPS:
            raise ConfigError(
                f"weights.tuning.steps must be at most {MAX_TUNING_STEPS}, found {self.steps}",
                hint="the built-in w3-tuned uses 64 steps per block",
            )
        if not (math.isfinite(self.lr) and 0.0 < self.lr <= MAX_TUNING_LR):
            raise ConfigError(
                f"weights.tuning.lr must be a number in (0, {MAX_TUNING_LR}], found {self.lr!r}",
                hint="1e-4 moves a 3-bit LUT level by about 1% of its spacing per step on SmolLM2",
            )
        check_at_least(self.tokens, 1, "weights.tuning.tokens")
        check_seed(self.seed, "weights.tuning.seed")
        moves = self.code_moves
        if isinstance(moves, bool) or not isinstance(moves, int | float) or not 0.0 <= moves <= MAX_CODE_MOVES:
            raise ConfigError(
                f"weights.tuning.code_moves must be a share in [0, {MAX_CODE_MOVES}], found {moves!r}",
                hint="0.01 (PV-tuning's bound: 1% of a linear's codes a step), or 0 to keep the codes",
            )
        check_choice(self.lr_schedule, LR_SCHEDULES, "weights.tuning.lr_schedule")


#: Upper bounds of ``weights.distill``: the stage runs the whole model forward and backward once a step.
MAX_DISTILL_STEPS = 100_000
MAX_DISTILL_SAMPLES = MAX_GENERATED_SAMPLES


@dataclass(frozen=True)
class DistillConfig:
    """``weights.distill``: end-to-end distillation of the LUT values and norm gains after quantization (and
    after ``weights.tuning`` when both are set): the whole compressed model trained to match the original's
    next-token distribution (squeeze.quant.distill; the stage is squeeze.compression.distill_stage). Codes and
    format never change."""

    #: Adam steps, one window each (the whole model forward and backward; the early stop may end sooner).
    steps: int = 128
    #: Adam learning rate of the LUT values and the norm gains (the first step's, with the cosine schedule).
    lr: float = 1e-4
    #: Calibration tokens used at most (whole windows of the calibration's seq_len).
    tokens: int = 16384
    #: Sequences of the calibration's seq_len the original model samples itself (temperature 1) and that join the
    #: calibration windows: text beyond the calibration's domain (LLM-QAT's data-free distillation).
    generated_samples: int = 8
    #: ``cosine`` (the rate decays to 0 over ``steps``) or ``constant``.
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    #: Steps between two scores of the held-out windows (an eighth of each source's windows, at least one each).
    eval_every: int = 16
    #: Scores without improvement after which the run stops.
    patience: int = 3
    #: Seeds the window order and the sampled sequences.
    seed: int = 0

    def __post_init__(self) -> None:
        check_at_least(self.steps, 1, "weights.distill.steps")
        if self.steps > MAX_DISTILL_STEPS:
            raise ConfigError(
                f"weights.distill.steps must be at most {MAX_DISTILL_STEPS}, found {self.steps}",
                hint="each step runs the whole model forward and backward on one window; 128 is the built-in's",
            )
        if not (math.isfinite(self.lr) and 0.0 < self.lr <= MAX_TUNING_LR):
            raise ConfigError(
                f"weights.distill.lr must be a number in (0, {MAX_TUNING_LR}], found {self.lr!r}",
                hint="1e-4 (the default) moves a 3-bit LUT level by about 1% of its spacing per step on SmolLM2",
            )
        check_at_least(self.tokens, 1, "weights.distill.tokens")
        check_at_least(self.generated_samples, 0, "weights.distill.generated_samples")
        if self.generated_samples > MAX_DISTILL_SAMPLES:
            raise ConfigError(
                f"weights.distill.generated_samples must be at most {MAX_DISTILL_SAMPLES}, found "
                f"{self.generated_samples}",
                hint="8 sequences of 512 tokens take about a minute to sample on a 135M model",
            )
        check_choice(self.lr_schedule, LR_SCHEDULES, "weights.distill.lr_schedule")
        check_at_least(self.eval_every, 1, "weights.distill.eval_every")
        check_at_least(self.patience, 1, "weights.distill.patience")
        check_seed(self.seed, "weights.distill.seed")


@dataclass(frozen=True)
class WeightsConfig:
    """How target linears are quantized."""

    #: A registered weight format's method (squeeze.quant.schemes): ``squeeze`` (LUT) or ``rtn`` built in.
    method: str = "squeeze"
    bits: int = 4
    #: An average bits per weight over the quantized linears: compress then gives each linear (q/k/v and gate/up
    #: of a block together) the width, and the sparse part or none, that meet it with the least Fisher-weighted
    #: error (squeeze.compression.bit_budget); ``bits`` is then unused. None: every linear gets ``bits``.
    target_bpw: float | None = None
    #: Fraction of weights kept exactly in the sparse part, chosen by sensitivity (Fisher). squeeze only.
    sensitive_fraction: float = 0.0
    #: Fraction kept exactly in the sparse part, chosen by magnitude (outliers). squeeze only.
    outlier_fraction: float = 0.0
    #: ``fisher``: weight k-means by the diagonal Fisher; ``activation``: by each input column's mean square
    #: over the calibration tokens, forward passes only (squeeze.calibrate.activation: for models whose
    #: backward is out of reach); ``uniform``: plain k-means (ablation).
    sensitivity: Sensitivity = "fisher"
    #: RTN only: columns per quantization group; ``None`` = one group per output channel.
    group_size: int | None = None
    #: squeeze only: how each row's LUT is stored. ``float16`` (SqueezeLLM) or ``int8`` (8-bit levels on a
    #: per-row fp16 affine grid: half the LUT bits, ~0.1-0.2 fewer bits per weight at 3-4 bits).
    lut_dtype: LutDtype = "float16"
    #: squeeze only: GPTQ-style error compensation (squeeze.quant.ec): codes chosen column by column against
    #: each row's LUT, each column's error pushed onto the later columns through the inverse input Hessian
    #: (accumulated during calibration). Same artifact format; needs calibration text.
    error_compensation: bool = False
    #: squeeze only, with error_compensation: dampening added to the Hessian's diagonal, as a fraction of its mean.
    damp: float = 0.01
    #: squeeze only, with error_compensation: refit each row's LUT once to the compensated codes (least squares).
    refit_lut: bool = False
    #: squeeze only, with error_compensation: rounds of LNQ's alternation after the compensation (squeeze.quant.ec.
    #: refitted_codes): each row's LUT refitted by least squares under H, then the codes re-chosen with
    #: compensation against it; each row keeps its best pair by output error (never worse than 0 rounds).
    refit_rounds: int = field(default=0, metadata=OMIT_DEFAULT)  # left out of the plain form while 0: hashes unchanged
    #: squeeze only, with error_compensation: quantize the columns by descending diag(H), GPTQ's act-order
    #: (measured on SmolLM2 w3: 55.1 vs 57.2 WikiText-2 perplexity in the original column order).
    act_order: bool = False
    #: squeeze only, with error_compensation: sequences (of the calibration's seq_len tokens) the model samples
    #: itself (temperature 1, seeded by the run's seed) whose inputs are added to the Hessians, so the
    #: compensation is not fitted to the calibration text's domain alone (squeeze.calibrate.generated;
    #: SmolLM2-135M w3-ec, WikiText-2: 50.2 with 8 of them, 47.9 with 32, 54.4 with sotu.txt alone). 0: none.
    generated_samples: int = 0
    #: squeeze only, with error_compensation: rounds of the LUT refit against the loss (squeeze.quant.lnq): each
    #: row's levels refitted in closed form and its codes re-chosen by coordinate descent under the diagonal
    #: Fisher times the input correlation; each row keeps the iterate best on the Hessians of ``lnq_held_out``
    #: calibration windows the fit never sees (never worse there than the compensated k-means pair). 0: off.
    lnq_rounds: int = field(default=0, metadata=OMIT_DEFAULT)  # the lnq_* keys: omitted at default, hashes unchanged
    #: with lnq_rounds: the ridge toward the k-means levels, in units of each level's Fisher mass.
    lnq_ridge: float = field(default=0.1, metadata=OMIT_DEFAULT)
    #: with lnq_rounds: the fit's input correlation shrunk this far toward the identity (1: the k-means objective).
    lnq_shrink: float = field(default=0.1, metadata=OMIT_DEFAULT)
    #: with lnq_rounds: the calibration windows held out (the last ones; neither the Fisher nor the fitted
    #: Hessians see them) whose Hessians choose each row's iterate.
    lnq_held_out: int = field(default=4, metadata=OMIT_DEFAULT)
    #: Module-name suffixes of the nn.Linear layers (and 3-D expert parameters) to quantize; default: every
    #: registered model family's projections (squeeze.models.families.default_targets). A recipe names targets
    #: only to change them: the resolved list is what recipe.yaml, hashes and fingerprints hold.
    targets: tuple[str, ...] = field(default_factory=default_targets)
    #: Module-name substrings never quantized, even when they match a target.
    ignore: tuple[str, ...] = ("lm_head",)
    #: Quantize the token embedding and an untied LM head too: 8 / 6 (int8 / int6 per row, RTN) or 4 (a 4-bit
    #: per-row LUT, Fisher-weighted when the recipe is); None keeps them unquantized. A tied pair is quantized
    #: once. ``auto`` (with ``target_bpw`` only): the budget plans each embedding like a linear, kept in the
    #: source dtype or at 8, 6 or 4 bits, and its weights then count in the average ``target_bpw`` asks for.
    embedding_bits: int | EmbeddingAuto | None = None
    #: Block-wise tuning of the LUT values and norm gains against the original blocks' outputs (TuningConfig);
    #: None: the quantized values are written as the quantizer left them.
    tuning: TuningConfig | None = field(default=None, metadata=OMIT_DEFAULT)
    #: End-to-end distillation of the LUT values and norm gains against the original's logits (DistillConfig);
    #: None: no such stage.
    distill: DistillConfig | None = field(default=None, metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        # squeeze.limits is the one table; a recipe read from YAML passes its Literal checks in from_dict too,
        # these catch a WeightsConfig built in Python
        check_choice(self.method, methods(), "weights.method")
        check_choice(self.sensitivity, SENSITIVITIES, "weights.sensitivity")
        check_choice(self.lut_dtype, LUT_DTYPES, "weights.lut_dtype")
        check_weight_bits(self.bits, "weights.bits")
        if self.target_bpw is not None:
            _check_target_bpw(self.target_bpw)
        check_sparse_fractions(self.sensitive_fraction, self.outlier_fraction, "weights")
        if self.group_size is not None:
            check_group_size(self.group_size, "weights.group_size")
        self._check_options_of_format()
        self._check_error_compensation()
        self._check_embedding_bits()
        self._check_tuning()
        self._check_distill()
        if not self.targets:
            raise ConfigError(
                "weights.targets must name at least one module suffix, found an empty list",
                hint="leave weights.targets out for every linear, or name suffixes such as [q_proj, k_proj]",
            )

    def _check_embedding_bits(self) -> None:
        bits = self.embedding_bits
        if bits is not None and bits != EMBEDDING_AUTO and bits not in EMBEDDING_BITS:
            raise ConfigError(
                f"weights.embedding_bits must be one of {[*EMBEDDING_BITS, EMBEDDING_AUTO]} or null, found {bits!r}",
                hint="8 / 6: int8 / int6 rows (about 8.06 / 6.06 bits/weight), 4: a 4-bit LUT per row; auto: the "
                "target_bpw budget chooses; null keeps the embedding",
            )
        if bits == EMBEDDING_AUTO and self.target_bpw is None:
            raise ConfigError(
                "weights.embedding_bits auto needs weights.target_bpw: the width is chosen by the bits budget",
                hint="pass a budget (--target-bpw 3.5, or a recipe such as b3.5-e), or a fixed width "
                "(--embedding-bits 4, 6 or 8)",
            )

    def _check_tuning(self) -> None:
        """Tuning trains LUT values on calibration windows: a format without tunable levels (RTN) and a run
        without calibration (``sensitivity: uniform``) are refused here, before any work."""
        if self.tuning is None:
            return
        fmt = format_for_recipe(self)
        if fmt is None or not fmt.tunable:
            raise ConfigError(
                f"weights.tuning tunes LUT values, and method {self.method} has none to tune",
                hint="use method: squeeze (e.g. recipe w3-tuned), or remove weights.tuning",
            )
        if self.sensitivity == "uniform":
            raise ConfigError(
                "weights.tuning needs calibration windows, and sensitivity uniform compresses without calibration",
                hint="use --sensitivity fisher with a calibration text, or remove weights.tuning",
            )
        if self.sensitivity != "fisher":
            raise ConfigError(
                f"weights.tuning runs after a Fisher sensitivity pass only, found sensitivity {self.sensitivity}",
                hint="use --sensitivity fisher with a calibration text, or remove weights.tuning",
            )

    def _check_distill(self) -> None:
        """Distillation trains LUT values on calibration windows: refused for a format without levels and for a
        run without calibration text, as tuning is."""
        if self.distill is None:
            return
        fmt = format_for_recipe(self)
        if fmt is None or not fmt.tunable:
            raise ConfigError(
                f"weights.distill trains LUT values, and method {self.method} has none to train",
                hint="use method: squeeze (e.g. recipe w3-ec-distill), or remove weights.distill",
            )
        if self.sensitivity != "fisher":
            raise ConfigError(
                f"weights.distill runs after a Fisher sensitivity pass only, found sensitivity {self.sensitivity}",
                hint="use --sensitivity fisher with a calibration text, or remove weights.distill",
            )

    def _check_error_compensation(self) -> None:
        if not 0.0 < self.damp <= 1.0:
            raise ConfigError(
                f"weights.damp must be in (0, 1], found {self.damp!r}",
                hint="0.01 (GPTQ's default) adds 1% of the Hessian's mean diagonal",
            )
        defaults = WeightsConfig.__dataclass_fields__
        changed = [name for name in ERROR_COMPENSATION_OPTIONS if getattr(self, name) != defaults[name].default]
        if not self.error_compensation and changed:
            raise ConfigError(
                f"weights.{', weights.'.join(changed)}: used only with weights.error_compensation: true "
                f"(options of it: {', '.join(ERROR_COMPENSATION_OPTIONS)})",
                hint=f"add error_compensation: true, or remove {' / '.join(changed)}",
            )
        check_at_least(self.generated_samples, 0, "weights.generated_samples")
        self._check_refit_rounds()
        self._check_lnq()
        if self.generated_samples > MAX_GENERATED_SAMPLES:
            raise ConfigError(
                f"weights.generated_samples (--generated-samples) must be at most {MAX_GENERATED_SAMPLES}, found "
                f"{self.generated_samples}",
                hint="8 to 64 sampled sequences is the useful range (docs/guide/compress.md); each costs a model run "
                "of seq_len tokens",
            )

    def _check_refit_rounds(self) -> None:
        rounds = check_at_least(self.refit_rounds, 0, "weights.refit_rounds")
        if not 0 <= rounds <= MAX_REFIT_ROUNDS:
            raise ConfigError(
                f"weights.refit_rounds must be an integer from 0 to {MAX_REFIT_ROUNDS}, found {rounds!r}",
                hint="2 to 4 rounds take most of the gain; each adds one compensation pass per linear",
            )
        if rounds and self.refit_lut:
            raise ConfigError(
                f"weights.refit_lut and weights.refit_rounds ({rounds}) both refit the LUT: give one of them",
                hint="refit_rounds alternates refit and compensation and keeps the best; remove refit_lut",
            )

    def _check_lnq(self) -> None:
        rounds = check_at_least(self.lnq_rounds, 0, "weights.lnq_rounds")
        if rounds > MAX_REFIT_ROUNDS:
            raise ConfigError(
                f"weights.lnq_rounds must be an integer from 0 to {MAX_REFIT_ROUNDS}, found {rounds!r}",
                hint="2 to 4 rounds; each is one refit and one coordinate-descent sweep per linear",
            )
        defaults = WeightsConfig.__dataclass_fields__
        changed = [name for name in LNQ_OPTIONS if getattr(self, name) != defaults[name].default]
        if not rounds and changed:
            raise ConfigError(
                f"weights.{', weights.'.join(changed)}: used only with weights.lnq_rounds > 0",
                hint=f"add lnq_rounds: 3, or remove {' / '.join(changed)}",
            )
        if rounds and (self.refit_rounds or self.refit_lut):
            raise ConfigError(
                "weights.lnq_rounds and weights.refit_rounds / refit_lut all refit the LUT: give one of them",
                hint="lnq_rounds keeps the Fisher weighting and a held-out check; remove refit_rounds / refit_lut",
            )
        ridge, shrink = self.lnq_ridge, self.lnq_shrink
        if isinstance(ridge, bool) or not isinstance(ridge, int | float) or not 0.0 <= ridge <= MAX_LNQ_RIDGE:
            raise ConfigError(
                f"weights.lnq_ridge must be a number in [0, {MAX_LNQ_RIDGE:g}], found {ridge!r}",
                hint="0.1 (the default) pulls each level toward its k-means value with a tenth of its Fisher mass",
            )
        if isinstance(shrink, bool) or not isinstance(shrink, int | float) or not 0.0 <= shrink <= 1.0:
            raise ConfigError(
                f"weights.lnq_shrink must be a number in [0, 1], found {shrink!r}",
                hint="0.1 (the default); 1 drops the input correlations (the k-means objective itself)",
            )
        check_at_least(self.lnq_held_out, 1, "weights.lnq_held_out", hint="4 windows (the default) or more")

    def _check_options_of_format(self) -> None:
        """Every option the chosen format does not use keeps its default (the format registry says which)."""
        fmt = format_for_recipe(self)
        if fmt is None:
            raise ConfigError(
                f"weights.method {self.method} has no format for lut_dtype {self.lut_dtype}", hint="remove lut_dtype"
            )
        defaults = {f.name: f.default for f in fields(self)}
        for key in sorted(recipe_options() - fmt.recipe_options):
            if getattr(self, key) != defaults[key]:
                users = list(dict.fromkeys(c.method for c in formats() if key in c.recipe_options))
                raise ConfigError(
                    f"weights.{key} applies to method {' / '.join(users)} only, found "
                    f"{getattr(self, key)!r} with method {self.method}",
                    hint=f"remove {key}, or use method: {users[0]}",
                )


def _check_target_bpw(value: float) -> None:
    # the exact range depends on the model's shapes (LUT bytes per row): preflight checks it; here only what no
    # model can store (every code takes at least 2 bits)
    if not math.isfinite(value) or value < min(WEIGHT_BITS):
        raise ConfigError(
            f"weights.target_bpw must be a number of at least {min(WEIGHT_BITS)} (bits per weight), found {value!r}",
            hint="e.g. 3.5 (between 3- and 4-bit) or 2.5",
        )
