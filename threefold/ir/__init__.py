"""The compiler's intermediate representation: the stage values every pass reads and returns
(stages.py), helpers over their fx graphs (program.py), typed node annotations
(annotations.py), the pass contract (contracts.py) and stages saved as directories
(stage_io.py). It imports nothing from compiler/ or passes/: passes/ reads it, compiler/
orchestrates both."""
