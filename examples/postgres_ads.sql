-- The ads table `grace builder --catalog postgresql://... --changes postgresql://...`
-- follows (docs/DATA.md "PostgreSQL"): the catalog's fields as columns (those of your
-- targeting schema: these are the default schema's), a status, and change_seq, which the
-- trigger sets on every insert and update.
CREATE SEQUENCE ads_change_seq;

CREATE TABLE ads (
    ad_id         bigint PRIMARY KEY,
    status        text   NOT NULL DEFAULT 'active'
                         CHECK (status IN ('active', 'paused', 'deleted')),
    sid           integer[],
    embedding     real[],
    countries     text[],
    age_buckets   text[],
    genders       text[],
    locations     text[],
    campaign_id   bigint,
    advertiser_id bigint,
    change_seq    bigint NOT NULL DEFAULT 0
);

CREATE INDEX ads_change_seq_idx ON ads (change_seq);

-- Writers take one lock, held until their transaction ends, before their first statement
-- on the table locks any row: they stamp one after the other, so change_seq follows
-- commit order and a reader that has seen seq s has seen every change below s. (Without
-- it a transaction committing late could hold a lower seq than one already read, and its
-- change would be skipped; taken per row instead, the lock would deadlock with row locks.)
CREATE FUNCTION ads_lock() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('ads_change_seq'));
    RETURN NULL;
END $$;

CREATE TRIGGER ads_lock BEFORE INSERT OR UPDATE ON ads
    FOR EACH STATEMENT EXECUTE FUNCTION ads_lock();

CREATE FUNCTION ads_stamp() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.change_seq := nextval('ads_change_seq');
    RETURN NEW;
END $$;

CREATE TRIGGER ads_stamp BEFORE INSERT OR UPDATE ON ads
    FOR EACH ROW EXECUTE FUNCTION ads_stamp();

-- A DELETE leaves a tombstone: the row stays with status 'deleted' (stamped like any
-- update, so the feed sees the delete), and the builder's snapshot, which reads active
-- rows only, leaves it out. Purge old tombstones without the triggers, e.g.
--   BEGIN; SET LOCAL session_replication_role = replica;
--   DELETE FROM ads WHERE status = 'deleted' AND change_seq < <a built version's seq>; COMMIT;
CREATE FUNCTION ads_tombstone() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE ads SET status = 'deleted' WHERE ad_id = OLD.ad_id AND status <> 'deleted';
    RETURN NULL;  -- the row stays (deleting a tombstone changes nothing)
END $$;

CREATE TRIGGER ads_lock_delete BEFORE DELETE ON ads
    FOR EACH STATEMENT EXECUTE FUNCTION ads_lock();

CREATE TRIGGER ads_tombstone BEFORE DELETE ON ads
    FOR EACH ROW EXECUTE FUNCTION ads_tombstone();
