"""The model's forward, packfree's side of it: read the batch's boundaries once (:mod:`.reading`), decide what the
row is (:mod:`.unpacked`, :mod:`.rope_ids`, :mod:`.encoder_decoder`), and put them in effect for the layers
(:mod:`.context`) around the model's own forward (:mod:`.hook`). :mod:`.keywords` and :mod:`.signature` name the
keyword arguments involved."""
