"""qvl's exceptions: one base the command line turns into one line on stderr and exit status 2.

Every error qvl raises for bad input derives from `QvlError` and says what failed, the offending value, and
the fix. The subclasses also derive from the builtin their callers used to catch (ValueError, RuntimeError),
so code written against those keeps working.
"""

from __future__ import annotations


class QvlError(Exception):
    """Bad input or an unsupported request, with the value and the fix in the message (CLI: exit 2)."""


class ConfigError(QvlError, ValueError):
    """A recipe option, override or parallel layout that cannot work."""


class MissingConfigField(ConfigError):
    """A checkpoint's config.json lacks a field qvl must read (qvl never falls back to a guessed value)."""


class ConversionError(QvlError, ValueError):
    """A checkpoint that cannot be converted or verified as asked."""


class DataError(QvlError, ValueError):
    """Input data (conversations, media, a prepared dataset) that cannot be used as asked."""


class LaunchError(QvlError, ValueError):
    """A launch request that would fail on the cluster: layout, executor settings, mounts."""


class UnsupportedOnCPU(ConfigError):
    """A configuration asks for something the CPU runtime cannot run."""


class OptionalPackageUnavailable(QvlError, RuntimeError):
    """Code reached a feature of an optional package that is not installed."""
