"""The built-in text the benchmark builds prompts from: varied English prose and code.

Prompts are sampled from these sentences (not random token ids) so that a model sees
text that reads like language, as it would in production. Everything is ASCII, so a
prompt cut at any piece boundary decodes back to the same text.
"""

from __future__ import annotations

PROSE: tuple[str, ...] = (
    "The river had risen overnight, and by morning the lower road was under a foot of brown water.",
    "She kept her grandmother's recipe for apricot jam in a tin box above the stove.",
    "Most of the town's bakeries open before five, when the first trains leave for the city.",
    "A good map shows not only where the roads go but also which of them are worth taking.",
    "The committee met twice in March and agreed on nothing except the date of the next meeting.",
    "Cold air sinks into the valley at night, so frost forms there long before it reaches the hills.",
    "He tuned the old piano himself, one string at a time, with a borrowed wrench and a lot of patience.",
    "Our flight was delayed by three hours, which gave us time to read half a novel at the gate.",
    "The museum's newest exhibit traces the history of glassmaking from ancient Egypt to Venice.",
    "When the power went out, the neighbours gathered on the porch and told stories by candlelight.",
    "Bees can recognise the faces of the people who tend their hives, or so the beekeeper insisted.",
    "A single oak tree may support hundreds of species of insects, birds and fungi.",
    "The recipe calls for two cups of flour, a pinch of salt and more butter than seems reasonable.",
    "Every spring the orchard fills with blossom, and every autumn the same ladder comes out of the barn.",
    "The library extended its hours during exam season, and the reading room stayed full until midnight.",
    "After the storm, volunteers spent a week clearing fallen branches from the trails.",
    "The bridge was built in eighteen months, which was considered remarkably fast at the time.",
    "Sailors once navigated by the stars, reading the night sky the way we read a clock.",
    "The market sells fresh fish on Tuesdays and Fridays, and the queue starts before dawn.",
    "She learned to speak Portuguese by listening to the radio while she cooked dinner.",
    "The old lighthouse keeper logged the weather every four hours for thirty-one years.",
    "Tea was once so valuable that it was kept in locked chests and measured out by the mistress of the house.",
    "The hikers reached the summit just as the clouds parted and the whole range came into view.",
    "A well-written contract anticipates the disagreements that the parties hope will never happen.",
    "The village council voted to repair the fountain rather than replace it with a modern one.",
    "He keeps a notebook of every bird he has seen, with the date, the place and the weather.",
    "Snow fell steadily through the afternoon, muffling the sound of traffic on the main street.",
    "The violinist practised the same eight bars for an hour before she was satisfied.",
    "Good soil is alive: a handful of it holds more organisms than there are people on Earth.",
    "The train wound slowly through the mountains, stopping at stations that were little more than a bench.",
    "Her first job was sorting letters at the post office during the holiday rush.",
    "The festival closes with a parade of lanterns that drifts down to the harbour after dark.",
    "Carpenters measure twice and cut once, because wood is cheaper than regret.",
    "The lecture covered the causes of the war in forty minutes and left ten for questions.",
    "In the dry season the lake shrinks to half its size and the flamingos move to the far shore.",
    "Their garden grows tomatoes, beans, squash and an alarming number of zucchini.",
    "The detective noticed that the clock on the mantel had stopped at a quarter past nine.",
    "Wind turbines on the ridge turn slowly even on days when the air feels perfectly still below.",
    "The children built a fort out of cardboard boxes and refused to leave it for dinner.",
    "A surprising number of famous inventions began as mistakes in someone else's experiment.",
    "The ferry runs every hour in summer, but only three times a day once the tourists have gone.",
    "He repaired bicycles in his garage and never charged more than the price of the parts.",
    "The mountain pass is closed from November to April, when the snow is too deep to clear.",
    "Marathon runners often say that the race really begins at the thirtieth kilometre.",
    "The painting was hidden behind a wall for sixty years before a plumber found it.",
    "Coffee beans are actually the seeds of a cherry-like fruit that grows on shrubs.",
    "The town's clock tower has been running five minutes fast since anyone can remember.",
    "Fog rolled in from the sea and swallowed the pier one lamp post at a time.",
    "Astronomers discovered the planet by measuring a tiny dip in the brightness of its star.",
    "The bakery's sourdough starter is older than the bakery itself and has moved house twice.",
    "A quiet room, a clear deadline and a pot of coffee can make almost any essay possible.",
    "The hospital opened a new wing for children, with murals painted by local artists.",
    "Historians still argue about why the ancient city was abandoned so suddenly.",
    "The team celebrated their first win of the season with pizza in the locker room.",
    "Many languages have a word for the smell of rain on dry earth.",
    "The farmer checks the sky every evening and trusts it more than the forecast.",
    "A bookshop cat is a fixture in many small towns, and some of them have their own fan mail.",
    "The engineers tested the dam's spillway by releasing water slowly over a whole weekend.",
    "Jazz musicians often say that the notes you leave out matter as much as the ones you play.",
    "The orchestra tuned to a single note from the oboe before the conductor walked on stage.",
    "Migrating geese fly in a V because each bird saves energy in the wake of the one ahead.",
    "The shop on the corner sells newspapers, stamps, batteries and, for some reason, fishing bait.",
    "She wrote her thesis on the economics of medieval trade fairs.",
    "Glaciers carve valleys into a U shape, while rivers cut them into a V.",
    "The recipe was passed down through four generations, each of which added a little more garlic.",
    "A power cut in the data centre took the website offline for twenty minutes on Monday.",
    "Gardeners plant marigolds between the vegetables because their scent keeps some pests away.",
    "The referee's decision was debated for weeks on every sports programme in the country.",
    "The old mill still grinds flour on the first Saturday of every month.",
    "Octopuses can change colour in a fraction of a second, even though they are colour-blind.",
    "The conference moved online that year, and attendance doubled.",
    "Most of the moon's craters were formed billions of years ago and have barely changed since.",
    "The tailor could tell your measurements just by watching you walk into the shop.",
    "A long weekend by the sea is often enough to remember what a slow morning feels like.",
    "The students planted a row of saplings along the edge of the playground.",
    "Desert plants store water in thick leaves and open their pores only at night.",
    "The printing press made books cheap enough that ordinary families could own a few.",
    "He always packs an umbrella, a spare charger and a paperback, whatever the trip.",
    "The auction house expected the vase to sell for a few hundred pounds; it fetched ten thousand.",
    "A river delta shifts its channels over the years, so old maps quickly become wrong.",
    "The restaurant changes its menu every week, depending on what the fishermen bring in.",
    "Volunteers count the butterflies in the meadow every July to track how the population changes.",
    "The stadium holds sixty thousand people and empties in less than twenty minutes.",
    "Salt was once used as money, which is where the word salary comes from.",
    "Her grandfather built the wooden boat by hand over three winters in the shed.",
    "The negotiations lasted until four in the morning, when both sides finally signed.",
    "Penguins huddle together in winter, taking turns on the cold outer edge of the group.",
    "The choir rehearses in the church hall on Thursday evenings, whatever the weather.",
    "An apprentice learns as much by watching the master's hands as by listening to the explanations.",
    "The path follows the old railway line, so it never climbs more than a gentle slope.",
    "Weather satellites photograph the whole planet several times a day.",
    "The cheese is aged in caves where the temperature barely changes all year.",
    "A kind word at the right moment can change the course of someone's whole day.",
    "The city planted trees along the avenue, and ten years later the street is several degrees cooler.",
    "In the story, the fox outwits the hunter by walking backwards in its own footprints.",
    "The new bridge opened with a ribbon, a brass band and a traffic jam.",
    "Mushrooms appear after autumn rain, pushing up through the leaves almost overnight.",
    "The apprentice chef spent her first month peeling potatoes and chopping onions.",
    "Old houses creak at night as the timbers cool and contract.",
    "The harbour master knows every boat by the sound of its engine.",
    "Reading aloud to children helps them learn words long before they can read on their own.",
    "A thunderstorm can hold as much energy as a small power station produces in a day.",
    "The garden party was moved indoors at the last minute when the sky turned grey.",
    "The translator kept a list of words that have no exact equivalent in English.",
    "Some of the oldest trees in the forest were already tall when the cathedral was built.",
    "The team spent a month collecting data and an afternoon realising it answered the wrong question.",
    "The kettle clicked off, the toast popped up, and for a moment everything in the kitchen was right.",
    "Caching a result is only worth it if the same question is asked again before the answer changes.",
    "A queue grows without bound when requests arrive faster, on average, than they can be served.",
    "The scheduler admits waiting requests only when there is room left in the step's token budget.",
    "Latency percentiles tell you what the slowest users experience, which an average hides.",
    "Prefill processes the whole prompt at once, while decode produces one token after another.",
    "Engineers measure before they optimise, because intuition about bottlenecks is often wrong.",
    "The report was short, clear and three weeks late, which everyone agreed was a fair trade.",
    "A backup that has never been restored is only a hope, not a backup.",
    "The server logged every request, but nobody had looked at the logs in months.",
    "Good documentation answers the question the reader has, not the one the writer wanted to answer.",
    "The product launch went smoothly, except for the coffee machine, which broke at nine sharp.",
    "A hash table trades memory for speed, and most of the time that is a good bargain.",
    "The experiment was repeated five times, and the effect held up every time.",
    "She sketched the design on a napkin, and the prototype looked almost exactly the same.",
    "Memory bandwidth, not arithmetic, limits how fast a small model can generate text on a CPU.",
    "The old terminal still printed receipts on paper that curled like autumn leaves.",
    "Every release note starts with good intentions and ends with a list of known issues.",
    "The cat sat on the warm laptop as if it had been designed for exactly that purpose.",
    "The tide tables are printed in the local paper every week for the fishermen and the surfers.",
    "The expedition carried enough food for forty days and came back after thirty-eight.",
    "A language model predicts the next word, and then the next, and then the next.",
    "The garden hose had a knot in it that no one could explain.",
    "The hotel's breakfast room looked out over the bay, where the first boats were heading out.",
    "The pharmacist explained the dosage twice and wrote it on the box as well.",
    "Street musicians play near the station, where the acoustics of the arches are best.",
    "The village shop closes at noon on Wednesdays, a custom older than anyone who works there.",
    "Bread rises because yeast turns sugar into gas, which the gluten traps in tiny bubbles.",
    "The fire brigade held an open day, and the children were allowed to sit in the engine.",
    "A careful reader notices what the author chose not to say.",
    "The climbing club meets at the quarry every Sunday when the rock is dry.",
    "The novel begins with a letter that arrives forty years too late.",
    "Rain gauges on the roof of the school have recorded every storm since 1952.",
    "The architect wanted the building to look as if it had grown out of the hillside.",
    "Ships in the canal are raised and lowered through a flight of nine locks.",
    "Her notes from the meeting were better organised than the meeting itself.",
)

QUESTIONS: tuple[str, ...] = (
    "What is the main point of the passage above?",
    "Summarise the text in two sentences.",
    "Which details in the document support the conclusion?",
    "List three facts mentioned above and explain why they matter.",
    "How would you explain this to someone who has never heard of it?",
    "What question does the text leave unanswered?",
    "Rewrite the key idea as a short headline.",
    "Is there anything in the passage that seems inconsistent?",
    "Give one example from the text and say what it illustrates.",
    "What would be a good title for this document?",
)

CODE: tuple[str, ...] = (
    '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out''',
    """class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}

    def get(self, key):
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value

    def put(self, key, value):
        self.items.pop(key, None)
        self.items[key] = value
        if len(self.items) > self.capacity:
            oldest = next(iter(self.items))
            del self.items[oldest]""",
    """function debounce(fn, delay) {
  let timer = null;
  return function (...args) {
    clearTimeout(timer);
    timer = setTimeout(() => fn.apply(this, args), delay);
  };
}""",
    """SELECT customer_id, COUNT(*) AS orders, SUM(total) AS revenue
FROM orders
WHERE created_at >= DATE '2024-01-01'
GROUP BY customer_id
HAVING COUNT(*) > 3
ORDER BY revenue DESC
LIMIT 20;""",
    """fn parse_pair(line: &str) -> Option<(String, i64)> {
    let mut parts = line.splitn(2, '=');
    let key = parts.next()?.trim().to_string();
    let value = parts.next()?.trim().parse().ok()?;
    Some((key, value))
}""",
    """func worker(id int, jobs <-chan int, results chan<- int) {
	for j := range jobs {
		results <- j * 2
	}
	fmt.Println("worker", id, "done")
}""",
    """#!/usr/bin/env bash
set -euo pipefail
for file in logs/*.log; do
  count=$(grep -c ERROR "$file" || true)
  echo "$file: $count errors"
done""",
    """import json
from pathlib import Path


def load_config(path):
    data = json.loads(Path(path).read_text())
    defaults = {"retries": 3, "timeout": 10.0}
    defaults.update(data)
    return defaults""",
    """def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1""",
    """async function fetchJson(url, retries = 3) {
  for (let attempt = 0; attempt < retries; attempt++) {
    const response = await fetch(url);
    if (response.ok) {
      return response.json();
    }
  }
  throw new Error(`failed to fetch ${url}`);
}""",
    """struct Point {
    double x;
    double y;
};

double distance(const Point& a, const Point& b) {
    double dx = a.x - b.x;
    double dy = a.y - b.y;
    return std::sqrt(dx * dx + dy * dy);
}""",
    """@dataclass
class Order:
    order_id: str
    items: list[str]
    paid: bool = False

    def total(self, prices):
        return sum(prices[item] for item in self.items)""",
)

CODE_TASKS: tuple[str, ...] = (
    "Write a function that does the same thing in another language.",
    "Add tests for the code above.",
    "Explain what this code does and point out any bugs.",
    "Refactor the code above to make it easier to read.",
    "Add type hints and docstrings to the code above.",
    "Make the code above handle empty input correctly.",
)

# Words that open a request's unique lead; the number that follows makes it unique.
LEAD_WORDS: tuple[str, ...] = ("Ticket", "Case", "Note", "Entry", "Item", "Record", "Memo", "Query")
