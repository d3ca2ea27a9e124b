"""The launch's progress fraction: it follows the steps, engines loaded included."""

import pytest

from xinference.core.launch_phases import LAUNCH_PHASES, launch_fraction


def test_the_fraction_grows_through_the_phases_and_with_each_loaded_engine():
    seen = []
    for phase, _ in LAUNCH_PHASES:
        if phase == "engines":
            seen += [launch_fraction(phase, loaded, 2) for loaded in (0, 1, 2)]
        else:
            seen.append(launch_fraction(phase, 0, 2))
    assert seen == sorted(seen)  # never moves back
    assert seen[0] == 0.0 and seen[-1] < 1.0
    # the engines' share is most of the bar, and each loaded engine moves it
    assert launch_fraction("engines", 0, 2) == 0.2
    assert launch_fraction("engines", 1, 2) == 0.5
    assert launch_fraction("engines", 2, 2) == 0.8
    assert launch_fraction("mapping", 2, 2) == 0.85
    assert sum(share for _, share in LAUNCH_PHASES) == pytest.approx(1.0)


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown launch phase 'warp'"):
        launch_fraction("warp", 0, 2)
