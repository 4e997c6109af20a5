import { prng } from '../../test/fixtures/grammar-schemas';
import { matches, parseGbnf, type ParsedGrammar } from './gbnf-match';
import { schemaToGbnf } from './index';

interface Keywords {
  minimum?: number;
  maximum?: number;
  exclusiveMinimum?: number;
  exclusiveMaximum?: number;
  multipleOf?: number;
}

const grammarOf = (schema: Record<string, unknown>): ParsedGrammar => {
  const r = schemaToGbnf(schema);
  if (!r.ok) throw new Error(`${JSON.stringify(schema)}: ${r.message}`);
  return parseGbnf(r.gbnf);
};

/** A decimal text as digits · 10^-scale, exactly. */
function decimal(text: string): { digits: bigint; scale: number } {
  const m = /^(-?)(\d+)(?:\.(\d+))?(?:e([+-]?\d+))?$/i.exec(text)!;
  let digits = BigInt(m[2]! + (m[3] ?? ''));
  let scale = (m[3] ?? '').length - Number(m[4] ?? 0);
  if (scale < 0) {
    digits *= 10n ** BigInt(-scale);
    scale = 0;
  }
  return { digits: m[1] ? -digits : digits, scale };
}

/**
 * Ajv's verdict on a number text: the bounds compared as doubles (as Ajv does), the type
 * checked on the double, `multipleOf` in exact decimal arithmetic (the grammar's meaning; see
 * numbers.ts on Ajv's float division).
 */
function valid(text: string, integer: boolean, kw: Keywords): boolean {
  const x = Number(text);
  if (integer && !Number.isInteger(x)) return false;
  if (kw.minimum !== undefined && !(x >= kw.minimum)) return false;
  if (kw.maximum !== undefined && !(x <= kw.maximum)) return false;
  if (kw.exclusiveMinimum !== undefined && !(x > kw.exclusiveMinimum)) return false;
  if (kw.exclusiveMaximum !== undefined && !(x < kw.exclusiveMaximum)) return false;
  if (kw.multipleOf !== undefined) {
    const a = decimal(text);
    const b = decimal(String(kw.multipleOf));
    if ((a.digits * 10n ** BigInt(b.scale)) % (b.digits * 10n ** BigInt(a.scale)) !== 0n) return false;
  }
  return true;
}

/** The shortest decimal text of n thousandths. */
const thousandths = (n: number): string => {
  const sign = n < 0 ? '-' : '';
  const a = Math.abs(n);
  const frac = String(a % 1000)
    .padStart(3, '0')
    .replace(/0+$/, '');
  return `${sign}${Math.floor(a / 1000)}${frac ? `.${frac}` : ''}`;
};

/** The exact decimal expansion of a double. */
function exactDecimal(x: number): string {
  if (Number.isInteger(x)) return BigInt(x).toString();
  let scale = 0;
  let y = Math.abs(x);
  while (!Number.isInteger(y)) {
    y *= 2;
    scale++;
  }
  const digits = (BigInt(y) * 5n ** BigInt(scale)).toString().padStart(scale + 1, '0');
  return `${x < 0 ? '-' : ''}${digits.slice(0, -scale)}.${digits.slice(-scale)}`;
}

const view = new DataView(new ArrayBuffer(8));
const nextUp = (x: number): number => {
  if (x === 0) return Number.MIN_VALUE;
  view.setFloat64(0, x);
  view.setBigUint64(0, view.getBigUint64(0) + (x > 0 ? 1n : -1n));
  return view.getFloat64(0);
};
const nextDown = (x: number): number => -nextUp(-x);

function pickKeywords(random: () => number, bound: () => number, steps: (number | undefined)[]): Keywords {
  const kw: Keywords = {};
  const a = bound();
  const b = bound();
  const [lo, hi] = a <= b ? [a, b] : [b, a];
  if (random() < 0.8) kw[random() < 0.5 ? 'minimum' : 'exclusiveMinimum'] = lo;
  if (random() < 0.8) kw[random() < 0.5 ? 'maximum' : 'exclusiveMaximum'] = hi;
  const step = steps[Math.floor(random() * steps.length)];
  if (step !== undefined) kw.multipleOf = step;
  return kw;
}

describe('numbers: the grammar admits exactly what Ajv admits (in canonical form)', () => {
  test('random integer ranges, exclusive bounds and multiples, every integer near them', () => {
    const random = prng(1);
    let checked = 0;
    for (let i = 0; i < 50; i++) {
      const kw = pickKeywords(random, () => Math.round((random() - 0.5) * 2400), [undefined, undefined, 1, 2, 3, 5, 7, 10, 12, 25, 0.5, 1.5]);
      const schema = { type: 'integer', ...kw };
      const r = schemaToGbnf(schema);
      const candidates = new Set<number>();
      for (let n = -150; n <= 150; n++) candidates.add(n);
      for (let j = 0; j < 150; j++) candidates.add(Math.round((random() - 0.5) * 3000));
      for (const b of Object.values(kw) as number[]) for (let d = -2; d <= 2; d++) candidates.add(Math.round(b) + d);
      if (!r.ok) {
        // Refused only when nothing is valid.
        expect([...candidates].filter((n) => valid(String(n), true, kw))).toEqual([]);
        continue;
      }
      const g = parseGbnf(r.gbnf);
      for (const n of candidates) {
        expect([schema, n, matches(g, String(n))]).toEqual([schema, n, valid(String(n), true, kw)]);
        checked++;
      }
    }
    expect(checked).toBeGreaterThan(8_000);
  });

  test('random decimal ranges and decimal steps, on a grid of thousandths', () => {
    const random = prng(2);
    let checked = 0;
    for (let i = 0; i < 40; i++) {
      const kw = pickKeywords(random, () => Math.round((random() - 0.5) * 100_000) / 1000, [
        undefined,
        undefined,
        0.5,
        0.25,
        0.1,
        0.05,
        0.01,
        0.2,
        1.5,
        0.125,
        0.3,
      ]);
      const schema = { type: 'number', ...kw };
      const r = schemaToGbnf(schema);
      const candidates = new Set<number>();
      for (let j = 0; j < 300; j++) candidates.add(Math.round((random() - 0.5) * 120_000));
      for (let n = -1500; n <= 1500; n += 7) candidates.add(n);
      for (const b of Object.values(kw) as number[]) for (let d = -3; d <= 3; d++) candidates.add(Math.round(b * 1000) + d);
      if (!r.ok) {
        expect([...candidates].filter((n) => valid(thousandths(n), false, kw))).toEqual([]);
        continue;
      }
      const g = parseGbnf(r.gbnf);
      for (const n of candidates) {
        const text = thousandths(n);
        expect([schema, text, matches(g, text)]).toEqual([schema, text, valid(text, false, kw)]);
        checked++;
      }
    }
    expect(checked).toBeGreaterThan(8_000);
  });

  test('bounds at every magnitude: decimals around the doubles next to a bound parse to the side Ajv sees', () => {
    const random = prng(3);
    for (let i = 0; i < 80; i++) {
      const magnitude = 10 ** Math.floor((random() - 0.3) * 30);
      const m = (random() < 0.3 ? -1 : 1) * random() * magnitude;
      const keyword = (['minimum', 'maximum', 'exclusiveMinimum', 'exclusiveMaximum'] as const)[i % 4]!;
      const schema = { type: 'number', [keyword]: m };
      const g = grammarOf(schema);
      const F = Math.max(16, decimal(String(m)).scale);
      // Decimals on the grid of F fraction digits at and next to the doubles around m and their midpoints.
      const texts = new Set<string>([String(m), String(nextUp(m)), String(nextDown(m))]);
      for (const x of [m, nextUp(m), nextDown(m)]) {
        const exact = decimal(exactDecimal(x));
        const mid = decimal(exactDecimal(nextUp(x)));
        const scaleTo = (d: { digits: bigint; scale: number }) =>
          d.scale <= F ? d.digits * 10n ** BigInt(F - d.scale) : d.digits / 10n ** BigInt(d.scale - F);
        for (const base of [scaleTo(exact), (scaleTo(exact) + scaleTo(mid)) / 2n]) {
          for (let d = -2n; d <= 2n; d++) {
            const n = base + d;
            const s = (n < 0n ? -n : n).toString().padStart(F + 1, '0');
            texts.add(`${n < 0n ? '-' : ''}${s.slice(0, -F)}.${s.slice(-F)}`.replace(/\.?0+$/, '') || '0');
          }
        }
      }
      for (const text of texts) {
        if (decimal(text).scale > F || /e/i.test(text)) continue; // beyond the grid: the grammar is stricter
        if (Math.abs(Number(text)) > 2 ** 53 && Math.abs(m) < 2 ** 53) continue; // beyond the unbounded side's ±(2^53 − 1)
        expect([schema, text, matches(g, text)]).toEqual([schema, text, valid(text, false, { [keyword]: m })]);
      }
    }
  });

  test('a number written with trailing zeros or without its fraction is the same number', () => {
    const g = grammarOf({ type: 'number', multipleOf: 0.25, minimum: 0, maximum: 2 });
    for (const text of ['0.5', '0.50', '1', '1.0', '1.00', '2.00']) expect([text, matches(g, text)]).toEqual([text, true]);
    for (const text of ['0.500', '1.', '.5', '01', '2.01']) expect([text, matches(g, text)]).toEqual([text, false]);
  });

  test('a side without a bound stops at ±(2^53 − 1), beyond that one digit past the other bound', () => {
    const g = grammarOf({ type: 'integer', minimum: 0 });
    expect(matches(g, '9007199254740991')).toBe(true);
    expect(matches(g, '9007199254740992')).toBe(false);
    const n = grammarOf({ type: 'number', maximum: 0 });
    expect(matches(n, '-9007199254740991')).toBe(true);
    expect(matches(n, '-9007199254740991.5')).toBe(false);
    expect(matches(n, '-0.0000000000000001')).toBe(true);
  });

  test('beside a step that is not a binary fraction, a side without a bound stops a million steps from zero; bounds given are kept', () => {
    const g = grammarOf({ type: 'number', multipleOf: 0.05, minimum: 0 });
    expect(matches(g, '50000')).toBe(true);
    expect(matches(g, '49999.95')).toBe(true);
    expect(matches(g, '50000.05')).toBe(false);
    expect(matches(g, '1234567.85')).toBe(false); // 1234567.85 / 0.05 = 24691357.000000004
    const given = grammarOf({ type: 'number', multipleOf: 0.05, minimum: 0, maximum: 2_000_000 });
    expect(matches(given, '1234567.85')).toBe(true);
    const integer = grammarOf({ type: 'integer', multipleOf: 0.3 });
    expect(matches(integer, '-300000')).toBe(true);
    expect(matches(integer, '300003')).toBe(false);
    const binary = grammarOf({ type: 'number', multipleOf: 0.25 }); // divides exactly: up to (2^53 − 1) / 4
    expect(matches(binary, '1234567890.25')).toBe(true);
    expect(matches(binary, '2251799813685247.75')).toBe(true); // (2^53 − 1) / 4, a double
    expect(matches(binary, '2251799813685248.25')).toBe(false); // reads as …248
    const halves = grammarOf({ type: 'number', exclusiveMinimum: 10, multipleOf: 2.5 }); // the property run's
    expect(matches(halves, '5262606177854832.5')).toBe(false);
    expect(matches(halves, '4503599627370492.5')).toBe(true); // below 2^52
  });
});
