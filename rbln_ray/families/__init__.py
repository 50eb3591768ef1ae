"""What rbln-ray knows about each model family it serves: one registry record per family
(:mod:`.registry`), the tiny-model recipes as data (:mod:`.tiny`), and one module per family
that has code of its own (named after it, e.g. :mod:`.qwen2_vl`), which keeps its kind's
contract (:mod:`.contract`). Code shared by several families' modules is in modules named for
what they share (:mod:`.vision_base`; the Qwen-VL base, :mod:`.qwen_vl_base` and its
siblings)."""
