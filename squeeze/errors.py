"""The error hierarchy. Every failure a user can cause is a SqueezeError.

Each error carries a one-line message (what was expected, what was found) and an optional hint (how to fix
it). The CLI prints ``Error: <message>`` then the hint, and exits with ``exit_code``. User input is checked
where it enters (recipes, specs, options: squeeze.limits; artifacts: the parsers); a broken contract inside
squeeze (its own code passing a wrong tensor) is a ValueError or TypeError, which the CLI reports as an
internal error (exit 3), never as the user's mistake. All of these classes are exported by ``squeeze``.
"""

from __future__ import annotations


class SqueezeError(Exception):
    """Base class of all errors squeeze raises on purpose."""

    #: Process exit code the CLI uses for this error: 2 = usage / malformed input, 1 = integrity failure.
    exit_code: int = 2
    #: What to do about an error of this class when the raise site gives no hint of its own: the CLI prints
    #: ``Hint: <hint or default_hint>``, so every refusal says how to fix it (a site's own hint is better).
    default_hint: str = "`squeeze COMMAND --help` lists what each option accepts"

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} (hint: {self.hint})"


class ConfigError(SqueezeError):
    """A recipe, calibration spec or command-line option is invalid (see squeeze.limits for what is supported)."""

    default_hint = (
        "fix the option or the recipe / spec key named above; `squeeze COMMAND --help` lists what each option "
        "accepts, and the built-in recipes show every key"
    )


class ModelError(SqueezeError):
    """A model cannot be found, opened, or has nothing to quantize; or its weights (or their Fisher) hold
    values that cannot be quantized (NaN, infinity, beyond float16)."""

    default_hint = (
        "squeeze takes causal-LM checkpoints transformers loads: a directory with config.json and safetensors "
        "weights, a model in the local Hugging Face cache, or a .gguf file"
    )


class CalibrationError(SqueezeError):
    """Calibration data is missing, too short, or unreadable."""

    default_hint = "pass a readable UTF-8 text file (or a built-in spec such as wikitext2-train) with --calibration"


class FormatError(SqueezeError):
    """A manifest, index or shard is malformed (cannot even be checked)."""

    default_hint = (
        "the file is damaged or was not written by this squeeze: `squeeze verify DIR` checks an artifact; "
        "pull or compress it again"
    )


class IntegrityError(SqueezeError):
    """The artifact's bytes differ from what its manifest signed off (hash, size, missing or extra file)."""

    exit_code = 1
    default_hint = "the artifact changed after it was sealed: pull or compress it again"


class TransferError(SqueezeError):
    """A download (``squeeze pull``) failed on the way (connection refused or dropped, timeout, server error).

    Nothing unverified is kept: rerunning the same pull resumes from the verified partial files.
    """

    default_hint = "check the network and the address, then rerun the same command: verified partial files are kept"

    def __init__(self, message: str, hint: str | None = None, *, retryable: bool = True) -> None:
        super().__init__(message, hint)
        self.retryable = retryable


class ResourceError(SqueezeError):
    """Not enough disk or memory for the requested work (checked before it starts)."""

    default_hint = "free memory or disk, or pass --force where the command offers it to try anyway"


class LockError(SqueezeError):
    """Another process holds the output directory (a concurrent ``squeeze compress`` into it)."""

    default_hint = "wait for the other run to finish (or stop it), or choose another --output"


class ResumeError(SqueezeError):
    """A work area cannot be resumed: its fingerprint differs from this run, or there is nothing to resume."""

    default_hint = "rerun with the original inputs, or pass --restart to discard the work area and start over"


class Interrupted(SqueezeError):
    """A run stopped on SIGINT or SIGTERM after committing its completed work; exit code 128 + signal."""

    default_hint = "rerun the same command to continue from the last committed work"

    def __init__(
        self,
        message: str,
        hint: str | None = None,
        *,
        signum: int = 2,
        work_dir: str | None = None,
        resumable: bool = True,
    ) -> None:
        super().__init__(message, hint)
        self.signum = signum
        self.exit_code = 128 + signum  # 130 for SIGINT, 143 for SIGTERM: what shells report for such deaths
        self.work_dir = work_dir
        #: False when nothing was committed (the work area is gone): rerun the command without --resume.
        self.resumable = resumable
