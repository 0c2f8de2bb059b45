"""How well a confidence head's estimates match acceptance, before and after per-position
temperatures (the peers' calibration: one temperature per block slot, by grid search for the
least expected calibration error).

The held-out evaluation counts, per slot, for every temperature of a grid and every
confidence bin, the confidence and the acceptance summed over the scored slots
(`confidence_bins`): sums add up over batches, so the whole held-out set is judged at once.
The slots are split by their anchor's parity: temperatures fitted on the even anchors are
judged on the odd ones (`calibration_report`), so the improvement is not measured on the
data that chose it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NUM_BINS = 10  # equal-width confidence bins, as the usual ECE
TEMPERATURES = np.geomspace(0.25, 4.0, 17)  # the grid: 1.0 is index 8
_UNSCALED = int(np.argmin(np.abs(TEMPERATURES - 1.0)))


def confidence_bins(
    logits: jax.Array,  # f32[R, A, B]: each slot's confidence logit
    accepted: jax.Array,  # f32[R, A, B]: its chance of acceptance (the head's target)
    scored: jax.Array,  # bool[R, A, B]
) -> jax.Array:
    """f32[2, G, B, NUM_BINS, 3]: by anchor parity, temperature of TEMPERATURES and slot,
    each confidence bin's summed confidence, summed acceptance and slot count."""
    temperatures = jnp.asarray(TEMPERATURES, jnp.float32)
    confidence = jax.nn.sigmoid(logits[None] / temperatures[:, None, None, None])  # [G,R,A,B]
    which = jnp.minimum((confidence * NUM_BINS).astype(jnp.int32), NUM_BINS - 1)
    one_hot = jax.nn.one_hot(which, NUM_BINS) * scored[None, ..., None]  # [G, R, A, B, K]
    odd = (jnp.arange(logits.shape[1]) % 2)[None, :, None]  # [1, A, 1]
    halves = []
    for parity in (0, 1):
        weight = one_hot * (odd == parity)[None, ..., None]
        halves.append(jnp.stack([
            jnp.einsum("graBk,graB->gBk", weight, confidence),
            jnp.einsum("graBk,raB->gBk", weight, accepted.astype(jnp.float32)),
            jnp.sum(weight, axis=(1, 2))], axis=-1))
    return jnp.stack(halves)


def expected_calibration_error(bins: np.ndarray) -> np.ndarray:
    """bins f64[..., NUM_BINS, 3] (confidence_bins' sums) -> f64[...]: the count-weighted mean
    over bins of |mean confidence - mean acceptance| (0 where nothing was counted)."""
    confidence, accepted, count = np.moveaxis(np.asarray(bins, np.float64), -1, 0)
    total = count.sum(axis=-1)
    return np.abs(confidence - accepted).sum(axis=-1) / np.maximum(total, 1.0)


def calibration_report(bins: np.ndarray) -> dict:
    """The held-out ECE of the confidence head as it is and with per-slot temperatures:
    `bins` f64[2, G, B, NUM_BINS, 3] summed over the held-out set. Temperatures are fitted
    slot by slot on the even anchors; both errors are over all slots of the odd ones, whose
    number comes with them (an ECE over few slots reads high from noise alone)."""
    fit, judge = np.asarray(bins, np.float64)
    chosen = np.argmin(expected_calibration_error(fit), axis=0)  # i[B]: per slot
    slots = np.arange(judge.shape[1])
    return {"ece": round(_pooled_error(judge[_UNSCALED]), 4),
            "ece_with_temperatures": round(_pooled_error(judge[chosen, slots]), 4),
            "temperatures": [round(float(t), 3) for t in TEMPERATURES[chosen]],
            "judged_slots": int(judge[_UNSCALED, ..., 2].sum())}


def _pooled_error(bins: np.ndarray) -> float:
    """bins f64[B, NUM_BINS, 3] -> the ECE of every slot's estimates together."""
    return float(expected_calibration_error(bins.sum(axis=0)))
