"""How sequence mixers run on packed rows: the mixer entry every covered layer gets (:mod:`.entry`), the native
tier through transformers' kernel seam (:mod:`.seam`), the per-sample tier (:mod:`.generic`), and the adapters by
family (:mod:`.registry`, filled by :mod:`.families` and :mod:`.encoders`)."""
