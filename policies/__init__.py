"""Reference eviction, prefetch and lookahead policies, registered by entry point like any third party's."""
