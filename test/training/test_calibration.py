"""The confidence head's held-out calibration (training/calibration.py) against an ECE
written here from its definition, and per-slot temperatures fitted on one half of the
anchors recovering a known miscalibration on the other."""

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.training.calibration import NUM_BINS, TEMPERATURES, calibration_report, confidence_bins

ROWS, ANCHORS, SLOTS = 3, 40, 4


def reference_ece(confidence: np.ndarray, accepted: np.ndarray) -> float:
    """Equal-width bins over [0, 1]; |mean confidence - mean acceptance| weighted by count."""
    which = np.minimum((confidence * NUM_BINS).astype(int), NUM_BINS - 1)
    gaps = [abs(confidence[which == b].mean() - accepted[which == b].mean())
            * np.sum(which == b) for b in range(NUM_BINS) if np.any(which == b)]
    return float(sum(gaps) / confidence.size)


def sample(seed: int, true_temperature: float):
    rng = np.random.default_rng(seed)
    logits = (3 * rng.standard_normal((ROWS, ANCHORS, SLOTS))).astype(np.float32)
    accepted = 1 / (1 + np.exp(-logits / true_temperature))
    scored = rng.random((ROWS, ANCHORS, SLOTS)) < 0.9
    return logits, accepted.astype(np.float32), scored


def test_raw_error_is_the_definition_over_the_odd_anchors():
    logits, _, scored = sample(0, 1.0)
    accepted = np.random.default_rng(1).random(logits.shape).astype(np.float32)
    bins = jax.jit(confidence_bins)(jnp.asarray(logits), jnp.asarray(accepted),
                                    jnp.asarray(scored))
    assert bins.shape == (2, len(TEMPERATURES), SLOTS, NUM_BINS, 3)
    odd = scored & (np.arange(ANCHORS) % 2 == 1)[None, :, None]
    expected = reference_ece(1 / (1 + np.exp(-logits[odd].astype(np.float64))),
                             accepted[odd].astype(np.float64))
    report = calibration_report(np.asarray(bins))
    assert abs(report["ece"] - expected) < 1e-4
    assert report["judged_slots"] == odd.sum()
    assert report["ece"] > 0.05  # random acceptance: far from calibrated


def test_temperatures_fitted_on_even_anchors_fix_the_odd_ones():
    """A head whose logits are twice what acceptance says (temperature 2 at every slot)."""
    logits, accepted, scored = sample(2, 2.0)
    report = calibration_report(np.asarray(confidence_bins(
        jnp.asarray(logits), jnp.asarray(accepted), jnp.asarray(scored))))
    assert report["temperatures"] == [2.0] * SLOTS
    assert report["ece"] > 0.05
    assert report["ece_with_temperatures"] < 1e-4
