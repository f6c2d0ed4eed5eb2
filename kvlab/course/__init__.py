"""The course layer: one module a chapter, holding exactly that chapter's figures, explorers and
exercise checkers, in the order its notebook uses them (`ch03_cache_memory.memory_explorer()`, …).

Chapters draw and check; what they compute is a concept of kvlab's core (`kvlab.memory`, `kvlab.gqa`,
`kvlab.quality`, `kvlab.roofline`, …), which never imports this package. `style` holds what every
chapter shares. A helper a later chapter reuses is imported from the chapter that introduced it.
Notebooks import their chapter: `from kvlab.course import ch03_cache_memory as ch03`.
See docs/architecture.md.
"""
