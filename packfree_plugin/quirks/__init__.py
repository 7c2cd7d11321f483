"""What packfree does for classes with a quirk of their own (their entry's fields): per-sample positions
(:mod:`.positions`, :mod:`.numbering`), dense masks (:mod:`.dense_masks`), decoder inputs (:mod:`.decoder_inputs`),
whole-row refusals and biases (:mod:`.whole_row`), pooled classification heads (:mod:`.task_heads`); installed on a
model and removed again by :mod:`.install`."""
