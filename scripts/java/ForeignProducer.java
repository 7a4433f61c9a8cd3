// A "foreign" producer: the official Apache Kafka Java client publishing JSON records the
// way production services do (compressed batches, idempotence, transactions), so that tests
// and the chaos script can check the worker reads what any producer writes.
//
// Run with the source launcher (Java 17+, no build step):
//
//   java -cp "$(scripts/dev-kafka.sh classpath)" scripts/java/ForeignProducer.java \
//       --bootstrap 127.0.0.1:9092 --topic T --count N \
//       [--compression none|gzip|snappy|lz4|zstd] [--transactions none|commit|abort-alternate] \
//       [--per-transaction K] [--partitions P] [--start-id I]
//
// Record n (from --start-id on) has key "k-<n>", partition n % P and the UTF-8 JSON value
// {"id": "java-<n>", "text": "<a deterministic English or Chinese sentence>"}.
// --transactions commit: every K records are one committed transaction; abort-alternate:
// transactions 0, 2, 4... are committed and 1, 3, 5... are aborted (their records are flushed
// to the log first, so a reader really has to skip them).
// At the end prints one JSON line to stdout:
//   {"sent": n, "compression": "...", "transactions": "...", "partitions": P,
//    "committed_ids": [...], "aborted_ids": [...]}
// Logging goes to stderr, warnings and worse only. Exit 2 on bad arguments, 1 on failure.

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.UUID;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.Future;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.common.serialization.StringSerializer;
import org.apache.logging.log4j.Level;
import org.apache.logging.log4j.core.appender.ConsoleAppender;
import org.apache.logging.log4j.core.config.Configurator;
import org.apache.logging.log4j.core.config.builder.api.ConfigurationBuilder;
import org.apache.logging.log4j.core.config.builder.api.ConfigurationBuilderFactory;
import org.apache.logging.log4j.core.config.builder.impl.BuiltConfiguration;

public class ForeignProducer {

  static final List<String> COMPRESSIONS = List.of("none", "gzip", "snappy", "lz4", "zstd");
  static final List<String> TRANSACTIONS = List.of("none", "commit", "abort-alternate");

  /** Bad command-line arguments (exit 2). */
  static final class UsageError extends Exception {
    UsageError(String message) {
      super(message);
    }
  }

  record Options(
      String bootstrap,
      String topic,
      int count,
      String compression,
      String transactions,
      int perTransaction,
      int partitions,
      long startId) {}

  public static void main(String[] argv) {
    quietLogging();
    Options options;
    try {
      options = parse(argv);
    } catch (UsageError e) {
      System.err.println("ForeignProducer: " + e.getMessage());
      System.err.println(
          "usage: ForeignProducer --bootstrap HOST:PORT --topic T --count N"
              + " [--compression none|gzip|snappy|lz4|zstd]"
              + " [--transactions none|commit|abort-alternate] [--per-transaction K]"
              + " [--partitions P] [--start-id I]");
      System.exit(2);
      return;
    }
    try {
      System.out.println(produce(options));
      System.out.flush();
      System.exit(0);
    } catch (Exception e) {
      Throwable cause = e instanceof ExecutionException && e.getCause() != null ? e.getCause() : e;
      System.err.println(
          "ForeignProducer: error: producing to " + options.topic() + " failed: " + cause);
      System.exit(1);
    }
  }

  // ------------------------------------------------------------------ arguments

  static Options parse(String[] argv) throws UsageError {
    Map<String, String> args = new HashMap<>();
    for (int i = 0; i < argv.length; i++) {
      String flag = argv[i];
      if (!flag.startsWith("--") || i + 1 >= argv.length) {
        throw new UsageError("expected --flag VALUE pairs, got '" + flag + "'");
      }
      args.put(flag.substring(2), argv[++i]);
    }
    List<String> known =
        List.of(
            "bootstrap", "topic", "count", "compression", "transactions", "per-transaction",
            "partitions", "start-id");
    for (String name : args.keySet()) {
      if (!known.contains(name)) {
        throw new UsageError("unknown option --" + name);
      }
    }
    String compression = args.getOrDefault("compression", "none");
    String transactions = args.getOrDefault("transactions", "none");
    if (!COMPRESSIONS.contains(compression)) {
      throw new UsageError("--compression must be one of " + COMPRESSIONS);
    }
    if (!TRANSACTIONS.contains(transactions)) {
      throw new UsageError("--transactions must be one of " + TRANSACTIONS);
    }
    return new Options(
        required(args, "bootstrap"),
        required(args, "topic"),
        intArg(args, "count", null, 0),
        compression,
        transactions,
        intArg(args, "per-transaction", "10", 1),
        intArg(args, "partitions", "0", 0),
        intArg(args, "start-id", "0", 0));
  }

  static String required(Map<String, String> args, String name) throws UsageError {
    String value = args.get(name);
    if (value == null || value.isBlank()) {
      throw new UsageError("--" + name + " is required");
    }
    return value;
  }

  static int intArg(Map<String, String> args, String name, String fallback, int min)
      throws UsageError {
    String value = fallback == null ? required(args, name) : args.getOrDefault(name, fallback);
    try {
      int parsed = Integer.parseInt(value);
      if (parsed < min) {
        throw new UsageError("--" + name + " must be at least " + min + ", got " + parsed);
      }
      return parsed;
    } catch (NumberFormatException e) {
      throw new UsageError("--" + name + " must be an integer, got '" + value + "'");
    }
  }

  // ------------------------------------------------------------------ producing

  static Properties config(Options options) {
    Properties props = new Properties();
    props.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, options.bootstrap());
    props.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
    props.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
    props.put(ProducerConfig.CLIENT_ID_CONFIG, "foreign-java-producer");
    props.put(ProducerConfig.ACKS_CONFIG, "all");
    props.put(ProducerConfig.ENABLE_IDEMPOTENCE_CONFIG, "true");
    props.put(ProducerConfig.COMPRESSION_TYPE_CONFIG, options.compression());
    // Many records per batch, so compression really applies (one batch per partition and linger).
    props.put(ProducerConfig.LINGER_MS_CONFIG, "20");
    props.put(ProducerConfig.BATCH_SIZE_CONFIG, String.valueOf(1 << 20));
    props.put(ProducerConfig.DELIVERY_TIMEOUT_MS_CONFIG, "60000");
    props.put(ProducerConfig.MAX_BLOCK_MS_CONFIG, "30000");
    if (!options.transactions().equals("none")) {
      String id = "foreign-" + options.topic() + "-" + UUID.randomUUID();
      props.put(ProducerConfig.TRANSACTIONAL_ID_CONFIG, id);
      props.put(ProducerConfig.TRANSACTION_TIMEOUT_CONFIG, "60000");
    }
    return props;
  }

  static String produce(Options options) throws Exception {
    List<String> committed = new ArrayList<>();
    List<String> aborted = new ArrayList<>();
    int partitions;
    try (KafkaProducer<String, byte[]> producer = new KafkaProducer<>(config(options))) {
      partitions =
          options.partitions() > 0
              ? options.partitions()
              : producer.partitionsFor(options.topic()).size();
      if (options.transactions().equals("none")) {
        committed.addAll(sendAll(producer, options, partitions, options.startId(), options.count()));
      } else {
        producer.initTransactions();
        long next = options.startId();
        long end = options.startId() + options.count();
        for (int txn = 0; next < end; txn++) {
          int size = (int) Math.min(options.perTransaction(), end - next);
          boolean abort = options.transactions().equals("abort-alternate") && txn % 2 == 1;
          producer.beginTransaction();
          List<String> ids = sendAll(producer, options, partitions, next, size);
          if (abort) {
            producer.abortTransaction();
            aborted.addAll(ids);
          } else {
            producer.commitTransaction();
            committed.addAll(ids);
          }
          next += size;
        }
      }
    }
    return summary(options, partitions, committed, aborted);
  }

  /** Sends records first..first+size-1, flushes, and fails unless the broker took every one. */
  static List<String> sendAll(
      KafkaProducer<String, byte[]> producer, Options options, int partitions, long first, int size)
      throws Exception {
    List<Future<RecordMetadata>> futures = new ArrayList<>();
    List<String> ids = new ArrayList<>();
    for (long n = first; n < first + size; n++) {
      int partition = (int) (n % partitions);
      byte[] value = value(n).getBytes(StandardCharsets.UTF_8);
      futures.add(
          producer.send(new ProducerRecord<>(options.topic(), partition, "k-" + n, value)));
      ids.add("java-" + n);
    }
    producer.flush();
    for (Future<RecordMetadata> future : futures) {
      future.get();
    }
    return ids;
  }

  // ------------------------------------------------------------------ records

  static final String[] SUBJECTS = {
    "The harbour pilot", "A tired librarian", "Our new neighbour", "The river", "An old compiler",
    "The night train", "A curious child", "The orchestra", "Every lighthouse keeper", "The wind",
  };
  static final String[] VERBS = {
    "quietly counts", "carefully repairs", "forgets", "sings about", "measures",
    "dreams of", "argues with", "paints", "follows", "rewrites",
  };
  static final String[] OBJECTS = {
    "the broken clocks of the village", "a map of forgotten islands", "seven blue umbrellas",
    "the last letter from the north", "a garden full of lemon trees", "the rules of the game",
    "an endless spreadsheet", "the shadows on the wall", "a song nobody remembers",
    "the price of fresh bread",
  };
  static final String[] ZH_SUBJECTS = {"老师", "渔夫", "小猫", "火车司机", "我的朋友", "图书管理员"};
  static final String[] ZH_VERBS = {"正在阅读", "慢慢地修理", "常常想起", "认真地画", "在寻找", "喜欢"};
  static final String[] ZH_OBJECTS = {
    "一本关于大海的旧书", "山上的小房子", "昨天的天气预报", "一首古老的诗", "城市里的灯光", "春天的第一朵花",
  };

  /** A deterministic, varied sentence: mostly English, every fourth one Chinese. */
  static String text(long n) {
    int a = (int) (n % 10);
    int b = (int) ((n / 10) % 10);
    int c = (int) ((n * 7 + 3) % 10);
    if (n % 4 == 3) {
      return ZH_SUBJECTS[a % 6] + ZH_VERBS[b % 6] + ZH_OBJECTS[c % 6] + "（第" + n + "号）。";
    }
    return SUBJECTS[a] + " " + VERBS[b] + " " + OBJECTS[c] + " (note " + n + ").";
  }

  static String value(long n) {
    return "{\"id\": " + quote("java-" + n) + ", \"text\": " + quote(text(n)) + "}";
  }

  // ------------------------------------------------------------------ output

  static String summary(
      Options options, int partitions, List<String> committed, List<String> aborted) {
    return "{\"sent\": "
        + (committed.size() + aborted.size())
        + ", \"topic\": "
        + quote(options.topic())
        + ", \"compression\": "
        + quote(options.compression())
        + ", \"transactions\": "
        + quote(options.transactions())
        + ", \"partitions\": "
        + partitions
        + ", \"committed_ids\": "
        + jsonList(committed)
        + ", \"aborted_ids\": "
        + jsonList(aborted)
        + "}";
  }

  static String jsonList(List<String> items) {
    List<String> quoted = new ArrayList<>(items.size());
    for (String item : items) {
      quoted.add(quote(item));
    }
    return "[" + String.join(", ", quoted) + "]";
  }

  /** A JSON string literal (non-ASCII kept as UTF-8). */
  static String quote(String s) {
    StringBuilder out = new StringBuilder("\"");
    for (char ch : s.toCharArray()) {
      switch (ch) {
        case '"' -> out.append("\\\"");
        case '\\' -> out.append("\\\\");
        case '\n' -> out.append("\\n");
        case '\r' -> out.append("\\r");
        case '\t' -> out.append("\\t");
        default -> {
          if (ch < 0x20) {
            out.append(String.format("\\u%04x", (int) ch));
          } else {
            out.append(ch);
          }
        }
      }
    }
    return out.append('"').toString();
  }

  /** Log4j2 (the slf4j binding on the classpath): warnings and worse, to stderr only. */
  static void quietLogging() {
    ConfigurationBuilder<BuiltConfiguration> builder =
        ConfigurationBuilderFactory.newConfigurationBuilder();
    builder.setStatusLevel(Level.ERROR);
    builder.setConfigurationName("foreign-producer");
    builder.add(
        builder
            .newAppender("stderr", "Console")
            .addAttribute("target", ConsoleAppender.Target.SYSTEM_ERR)
            .add(builder.newLayout("PatternLayout").addAttribute("pattern", "%p %c{1}: %m%n")));
    builder.add(builder.newRootLogger(Level.WARN).add(builder.newAppenderRef("stderr")));
    Configurator.initialize(builder.build());
  }
}
