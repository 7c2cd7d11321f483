"""User tools built on the core: the command line (``packfree demo / doctor / verify / bench``), the GSM8K demo,
the built-in benchmark, the environment report and the embedded data set. Nothing in the core imports them."""
