"""Adversarial campaigns against deltastore on real S3 servers (moto, SeaweedFS).

Each campaign is a script with a trial count that starts its own server(s) and, where it needs
one, a fault-injecting proxy; it reports what it counted (faults injected, versions lost,
corrupt applies, errors surfaced, wrong errors, invariant violations)::

    python -m campaigns.crash      --backend seaweedfs --trials 200   # kill -9 a publisher
    python -m campaigns.faults     --backend seaweedfs --trials 200   # 10% mixed S3 faults
    python -m campaigns.races      --backend seaweedfs --trials 120   # 3-4 publisher processes
    python -m campaigns.corruption --backend seaweedfs --trials 100   # damage objects in the bucket
    python -m campaigns.hostile    --backend seaweedfs --trials 200   # crafted HEADs/manifests/segments
    python -m campaigns all --backend seaweedfs --markdown table.md   # several, one Markdown table
    python -m campaigns all --backend seaweedfs --grid ...             # publishers write column grids
    python -m campaigns all --backend seaweedfs --formats fp8-block128,mxfp8   # serving streams too
    python -m campaigns.faults --formats fp8-block128,mxfp8 --format-churn 7   # a format dropped, published again

The oracle reads the store directly (never through the proxy) and recomputes the exact bits of
every version from its step (campaigns.model). docs/reliability.md has the figures.
"""
