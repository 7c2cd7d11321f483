"""Loading: registering ``"packfree"`` with transformers (:mod:`.register`), preparing and releasing a model
(:mod:`.prepare`), and the start-up hook that registers it before any model loads (:mod:`.autoload`)."""
