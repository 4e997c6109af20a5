/**
 * A bridge's upkeep of its instance's request consumer (README.md one folder up, "After a NATS
 * restart"): it pulls through one `consume()` at a time, pulls afresh from a new consumer leader,
 * creates the consumer again after a reconnect when the server lost it, and watches its
 * heartbeats and presence for the bridge's health.
 */
import {
  ConsumerEvents,
  millis,
  type Consumer,
  type ConsumerConfig,
  type ConsumerMessages,
  type JetStreamClient,
  type JetStreamManager,
  type NatsConnection,
  type Subscription,
} from 'nats';
import { laneConsumerConfig, restoreConsumer } from '../consumers';
import { declareOnReconnect } from '../declare';
import { consumerNameOf, laneConsumerNameOf, type DataPlaneNames, type Lane } from '../names';
import type { BridgeStats } from './metrics';

export interface RequestConsumerOptions {
  nc: NatsConnection;
  js: JetStreamClient;
  jsm: JetStreamManager;
  names: DataPlaneNames;
  pool: string;
  instance: string;
  /** Requests the engine serves at once: what is pulled at once (`max_messages` of each `consume()`), unless `holds`. */
  slots: number;
  /**
   * Pulls as many at once as the consumer's `max_ack_pending` allows, not `slots`: its bridge holds
   * them and serves them `slots` at a time in an order of its own (the `requeued` lane, held.ts).
   */
  holds?: boolean;
  stats: BridgeStats;
  log: (line: string) => void;
  /** Logs and counts an unexpected failure. */
  failed: (what: string, err: unknown) => void;
  /**
   * The consumer of one of the instance's lanes (names.ts `LANES`) instead of its requests',
   * created like `like` (the request consumer's configuration) when missing: an instance created
   * before that lane existed has none.
   */
  lane?: { lane: Lane; like: ConsumerConfig };
}

export class RequestConsumer {
  private messages!: ConsumerMessages;
  private missing = false;
  private lastHeartbeatMissAt = 0;
  private lastMessageAt = 0;
  private elected?: Subscription;
  /** Its bridge is stopping: it neither restores the consumer nor pulls afresh any more. */
  private stopping = false;

  private constructor(
    private readonly opts: RequestConsumerOptions,
    private readonly consumer: Consumer,
    /** The consumer's configuration when the bridge started: what it is created again with. */
    readonly config: ConsumerConfig,
  ) {}

  /** Gets the instance's request consumer (it must exist: ensureInstanceConsumer), or one of its lanes' (`lane`); pulls nothing yet. */
  static async open(opts: RequestConsumerOptions): Promise<RequestConsumer> {
    const { names, pool, instance } = opts;
    if (opts.lane) {
      const { lane, like } = opts.lane;
      await restoreConsumer(opts.jsm, names.requestStream, laneConsumerConfig(names, pool, instance, lane, like));
      const consumer = await opts.js.consumers.get(names.requestStream, laneConsumerNameOf(pool, instance, lane));
      return new RequestConsumer(opts, consumer, (await consumer.info()).config);
    }
    const consumer = await opts.js.consumers.get(names.requestStream, consumerNameOf(pool, instance));
    const { config } = await consumer.info();
    if ((config.max_ack_pending ?? 0) !== opts.slots) opts.log(`consumer max_ack_pending is ${config.max_ack_pending}, bridge slots ${opts.slots}`);
    return new RequestConsumer(opts, consumer, config);
  }

  /** Requests it pulls at once: `slots`, or when it `holds`, its consumer's `max_ack_pending` (no fewer). */
  get atOnce(): number {
    return this.opts.holds ? Math.max(this.opts.slots, this.config.max_ack_pending ?? 0) : this.opts.slots;
  }

  /** Its bridge holds what it delivers and serves it in an order of its own (held.ts). */
  get holds(): boolean {
    return this.opts.holds === true;
  }

  /** Which of the instance's lanes it pulls (undefined: its requests). */
  get lane(): Lane | undefined {
    return this.opts.lane?.lane;
  }

  /** What it is, in log lines and health problems. */
  get label(): string {
    return this.opts.lane ? `${this.opts.lane.lane} consumer` : 'request consumer';
  }

  /** The consumer's `ack_wait`. */
  get ackWaitMs(): number {
    return millis(this.config.ack_wait ?? 30_000_000_000);
  }

  /** The consumer's `max_deliver` (Infinity: unbounded). */
  get maxDeliver(): number {
    return this.config.max_deliver !== undefined && this.config.max_deliver > 0 ? this.config.max_deliver : Infinity;
  }

  /** The `consume()` pulling now; a new one replaces it (a pull loop moves over to it when this one ends). */
  get current(): ConsumerMessages {
    return this.messages;
  }

  /** Starts pulling, and keeps the consumer and its pull up after reconnects and leader elections. */
  async start(): Promise<void> {
    const { nc, jsm, names, log, failed } = this.opts;
    const isStopping = () => this.stopping;
    // Pulls through one `consume()` at a time; a new one replaces it when the consumer had to be
    // created again (the old one would only notice after its heartbeats went missing, ~30 s).
    this.messages = await this.consumer.consume({ max_messages: this.atOnce });
    this.watch(this.messages);

    // A server that restarted without its store (or lost the consumer some other way) would leave
    // this bridge pulling from nothing: after every reconnect it creates its consumer again, as it
    // was, unless it is stopping (a destroyed instance's consumer is deleted after its bridge stops).
    await declareOnReconnect(
      nc,
      async () => {
        const restored = await restoreConsumer(jsm, names.requestStream, this.config);
        // It is there now (a consumer-not-found seen during the outage is news no more; a
        // consumer nothing is sent to would otherwise stay "missing" until its first delivery).
        this.missing = false;
        if (!restored || isStopping()) return;
        log(`${this.label} was missing: created again`);
        await this.pullAfresh();
      },
      { what: this.label, log, isDone: isStopping },
    );

    // On a cluster the consumer (replicated like its stream) has a leader, which holds this
    // bridge's pull requests. A new leader (the old one's server died, or stepped down) knows
    // nothing of them: the old consume() would wait for its heartbeats to go missing (2 × 15 s)
    // before it pulled again, and until then no request is delivered. The server announces every
    // election: pull afresh from the new leader at once (measured, test/nats-cluster.int.test.ts:
    // a leader's SIGKILL paused clients ~30 s without this, ~7–10 s with it — the election).
    const durable = this.config.durable_name ?? consumerNameOf(this.opts.pool, this.opts.instance);
    this.elected = nc.subscribe(`$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.${names.requestStream}.${durable}`, {
      callback: (err) => {
        if (err || isStopping() || nc.isClosed()) return;
        log(`${this.label} has a new leader: pulling from it`);
        this.pullAfresh().catch((e: unknown) => failed('pulling from the new consumer leader', e));
      },
    });
  }

  /** A message arrived: the consumer is there and its heartbeats are no longer news. */
  delivered(): void {
    this.lastMessageAt = Date.now();
    this.missing = false;
  }

  /** What is wrong with the consumer, for the bridge's health. */
  problems(): string[] {
    const problems: string[] = [];
    if (this.missing) problems.push(`${this.label} missing`);
    if (this.lastHeartbeatMissAt > this.lastMessageAt && Date.now() - this.lastHeartbeatMissAt < 2 * 30_000) problems.push(`${this.label} heartbeats missed`);
    return problems;
  }

  /** The connection was closed from under us: stops pulling at once. */
  connectionClosed(): void {
    this.messages.stop();
  }

  /**
   * The bridge stops: no more restoring or pulling afresh; stops pulling at once when the
   * connection is closed, else by closing the `consume()` (which its pull loop awaits).
   */
  stopPulling(): Promise<unknown> {
    this.stopping = true;
    if (this.opts.nc.isClosed()) {
      this.messages.stop();
      return Promise.resolve();
    }
    return this.messages.close();
  }

  /** Requests in the consumer not delivered yet; null when that cannot be read now (NATS away, the consumer gone). */
  async undelivered(): Promise<number | null> {
    if (this.opts.nc.isClosed()) return null;
    return this.consumer.info().then(
      (i) => i.num_pending,
      () => null,
    );
  }

  /** Stops watching for leader elections. */
  close(): void {
    this.elected?.unsubscribe();
  }

  /** Pulls through a new `consume()` from now on; the pull loop moves over to it. */
  private async pullAfresh(): Promise<void> {
    const old = this.messages;
    this.messages = await this.consumer.consume({ max_messages: this.atOnce });
    this.watch(this.messages);
    old.stop();
  }

  private watch(current: ConsumerMessages): void {
    const { stats, log } = this.opts;
    void (async () => {
      for await (const s of await current.status()) {
        if (current !== this.messages) return; // replaced: what the old pull says is no news
        switch (s.type) {
          case ConsumerEvents.HeartbeatsMissed:
            stats.heartbeatsMissed += 1;
            this.lastHeartbeatMissAt = Date.now();
            log(`${this.label}: heartbeats missed (${String(s.data)})`);
            break;
          case ConsumerEvents.ConsumerNotFound:
          case ConsumerEvents.ConsumerDeleted:
          case ConsumerEvents.StreamNotFound:
          case ConsumerEvents.NoResponders:
            this.missing = true;
            log(`${this.label} unavailable: ${s.type}`);
            break;
          default:
            break;
        }
      }
    })().catch(() => undefined);
  }
}
