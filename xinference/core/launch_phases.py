"""How far a launch has come, as a fraction for a progress bar (pure).

A launch goes through fixed phases; each gets a share of the bar roughly as long
as it usually takes (loading the engines takes most of it), and the engine phase
advances by each replica whose engine has loaded. The fraction says which steps
are done, not a time estimate: it never moves back and reaches 1 only when every
replica serves.
"""

from __future__ import annotations

# (phase, share of the bar), in launch order
LAUNCH_PHASES: tuple[tuple[str, float], ...] = (
    ("validating", 0.0),
    ("resolving", 0.02),
    ("tracker", 0.03),
    ("pools", 0.15),
    ("engines", 0.6),
    ("transfer actors", 0.05),
    ("mapping", 0.15),
)
_NAMES = tuple(name for name, _ in LAUNCH_PHASES)
ENGINE_PHASE = "engines"


def launch_fraction(phase: str, replicas_loaded: int, replicas_total: int) -> float:
    """The share of the launch done at the start of ``phase``, plus, in the engine
    phase, the share of the engines already loaded."""
    if phase not in _NAMES:
        raise ValueError(f"unknown launch phase {phase!r}; phases: {_NAMES}")
    done = 0.0
    for name, share in LAUNCH_PHASES:
        if name == phase:
            if name == ENGINE_PHASE and replicas_total > 0:
                done += share * min(replicas_loaded, replicas_total) / replicas_total
            return round(done, 3)
        done += share
    raise AssertionError("unreachable")
