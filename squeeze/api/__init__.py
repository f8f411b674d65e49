"""The public face of squeeze: every verb of the CLI is one function here."""

from squeeze.api.compress import *  # noqa: F403
from squeeze.api.compress import __all__, evaluate_tasks, register  # noqa: F401
