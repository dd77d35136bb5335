-- The release policy's publish times (docs/architecture.md, "Release policy"): when this
-- fleet first saw each listed file, recorded once and never reset (eviction never touches
-- this table), and a publish time learnt from an upstream's Last-Modified (a Maven pom),
-- kept once known so it is asked for once per version.
CREATE TABLE publish_times (
    repository    text   NOT NULL,
    key           text   NOT NULL,
    first_seen_ms bigint NOT NULL,
    upstream_ms   bigint,
    PRIMARY KEY (repository, key)
);
