"""Models that ship with threefold (the main job trains threefold.models.gpt)."""
