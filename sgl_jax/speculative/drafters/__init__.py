"""The drafters: one module per drafter behind one interface, and their factories."""
