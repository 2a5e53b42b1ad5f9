//! What the benchmark programs of `src/bin` share: the CPU time they read off the machine, the
//! median they report, and the consumer benchmarks' queues, streams and handler.

/// CPU time as the benchmark programs read it: from `/proc` (user + system, in clock ticks of
/// 1/100 s) and from Redis's own count.
pub mod measure {
    /// A process's name and user + system CPU ticks, from its `/proc/<pid>/stat` (or
    /// `/proc/self/stat`).
    #[must_use]
    pub fn process_ticks(path: &str) -> Option<(String, f64)> {
        let stat = std::fs::read_to_string(path).ok()?;
        let (head, tail) = stat.rsplit_once(") ")?;
        let comm = head.split_once(" (")?.1.to_owned();
        // After the name: state is field 3 of the man page; utime and stime are fields 14 and 15.
        let fields: Vec<&str> = tail.split_whitespace().collect();
        let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
        Some((comm, ticks))
    }

    /// The CPU ticks so far of every process named `name` (its command name in `/proc`; several
    /// names separated by `|`), summed.
    #[must_use]
    pub fn ticks_of_processes_named(name: &str) -> f64 {
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| process_ticks(&entry.path().join("stat").to_string_lossy()))
            .filter(|(comm, _)| name.split('|').any(|name| comm == name))
            .map(|(_, ticks)| ticks)
            .sum()
    }

    /// `used_cpu_user + used_cpu_sys` of Redis's `INFO cpu` (the main process), in microseconds.
    #[must_use]
    pub fn info_cpu_usec(info: &str) -> f64 {
        info.lines()
            .filter_map(|line| line.strip_prefix("used_cpu_user:").or_else(|| line.strip_prefix("used_cpu_sys:")))
            .filter_map(|seconds| seconds.trim().parse::<f64>().ok())
            .sum::<f64>()
            * 1e6
    }

    /// The processes whose CPU time the consumer benchmarks count: the program itself, then, by
    /// the command name `/proc` gives them, RabbitMQ, NATS, Redis (or Valkey) and PostgreSQL (all
    /// of its processes).
    pub const CONSUMER_PROCESSES: [&str; 5] =
        ["this program", "beam.smp", "nats-server", "redis-server|valkey-server", "postgres"];

    /// The CPU ticks so far of this process and of each server of [`CONSUMER_PROCESSES`], summed
    /// per name.
    #[must_use]
    pub fn consumer_processes_ticks() -> [f64; CONSUMER_PROCESSES.len()] {
        std::array::from_fn(|i| match i {
            0 => process_ticks("/proc/self/stat").map_or(f64::NAN, |(_, ticks)| ticks),
            _ => ticks_of_processes_named(CONSUMER_PROCESSES[i]),
        })
    }

    /// The median of the finite values (the mean of the middle two for an even count), or NaN
    /// if there is none.
    #[must_use]
    pub fn median(mut values: Vec<f64>) -> f64 {
        values.retain(|v| v.is_finite());
        if values.is_empty() {
            return f64::NAN;
        }
        values.sort_by(f64::total_cmp);
        let mid = values.len() / 2;
        if values.len() % 2 == 1 { values[mid] } else { f64::midpoint(values[mid - 1], values[mid]) }
    }
}

/// Queues and streams filled for the consumer benchmarks (`consume_load`, `window_ceiling`): one
/// small message (`{}`) per id, each confirmed by the broker before the fill returns.
pub mod fill {
    use idempotent_runtime::consume::amqp::lapin::options::{
        BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    };
    use idempotent_runtime::consume::amqp::lapin::types::FieldTable;
    use idempotent_runtime::consume::amqp::lapin::{self, BasicProperties};
    use idempotent_runtime::consume::jetstream::async_nats::{self, jetstream};

    /// How many JetStream publish acks a fill has pending at most (the context allows 5,000).
    const PUBLISH_WINDOW: usize = 1000;

    /// Puts `channel` in confirm mode, declares `queue` and publishes one message per id (its
    /// `message_id`) through the default exchange.
    ///
    /// # Errors
    ///
    /// RabbitMQ's, when a declaration, publish or confirm fails.
    pub async fn amqp(
        channel: &lapin::Channel,
        queue: &str,
        ids: impl IntoIterator<Item = String>,
    ) -> Result<(), lapin::Error> {
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        channel.queue_declare(queue.into(), QueueDeclareOptions::default(), FieldTable::default()).await?;
        let mut confirms = Vec::new();
        for id in ids {
            let properties = BasicProperties::default().with_message_id(id.into());
            let options = BasicPublishOptions::default();
            confirms.push(channel.basic_publish("".into(), queue.into(), options, b"{}", properties).await?);
        }
        for confirm in confirms {
            confirm.await?;
        }
        Ok(())
    }

    /// Creates the stream `name` on the subject `bench.<name>` and publishes one message per id
    /// (its `Nats-Msg-Id` header); returns the stream.
    ///
    /// # Errors
    ///
    /// JetStream's, when the stream cannot be created or a publish is not acknowledged.
    pub async fn jetstream(
        js: &jetstream::Context,
        name: &str,
        ids: impl IntoIterator<Item = String>,
    ) -> Result<jetstream::stream::Stream, async_nats::Error> {
        let subject = format!("bench.{name}");
        let config =
            jetstream::stream::Config { name: name.to_owned(), subjects: vec![subject.clone()], ..Default::default() };
        let stream = js.create_stream(config).await?;
        // Acks awaited a window at a time: each pending ack holds one of the context's permits
        // (5,000 by default), and a publish waits for a free one, so holding the acks of every
        // message until the end stalled the fill for good at 5,001 messages.
        let mut acks = std::collections::VecDeque::with_capacity(PUBLISH_WINDOW);
        for id in ids {
            if acks.len() == PUBLISH_WINDOW {
                acks.pop_front().expect("a full window").await?;
            }
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", id.as_str());
            acks.push_back(js.publish_with_headers(subject.clone(), headers, "{}".into()).await?);
        }
        for ack in acks {
            ack.await?;
        }
        Ok(stream)
    }
}

/// The handler the consumer benchmarks run under `#[idempotent]`, keyed by the message id: it
/// counts the message (once per id, on the store given) and returns the count before it.
///
/// # Errors
///
/// The idempotency step's (the store down, the key claimed elsewhere).
#[idempotent_runtime::idempotent(key = id, store = store, scope = "consumer-bench", retention = "10m")]
pub async fn count_once<S: idempotent_runtime::Store>(
    store: &S,
    id: &str,
    handled: &std::sync::atomic::AtomicUsize,
) -> Result<usize, idempotent_runtime::Error> {
    Ok(handled.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}
