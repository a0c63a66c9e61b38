"""Writing graph bundles (imported as yggdrasil.graphs): the manifest's writing, describe, and what
turns a step into a package for an ISA (AOTInductor export, the Inductor ISA). Reading a bundle is
the runtime's, yggdrasil/storage/."""
