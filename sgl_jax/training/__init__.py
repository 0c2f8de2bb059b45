"""EAGLE3 draft training in pure JAX: data, draft vocabulary, target features, loss, export."""
