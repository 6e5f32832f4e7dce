"""Sharing the compile cache: the export registry, remotes, moving entries between the local
store and a remote, and the local housekeeping commands. Built on the store in ``nxdc.cache``."""
